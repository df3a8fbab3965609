"""Published EAGLE-1/2 drafts (`--draft eagle:PATH`): read from a checkpoint written in SafeAILab/EAGLE's
layout, checked against EAGLE's equations written out here, and exact under every tree policy."""

import json

import pytest
import torch
import torch.nn.functional as F

from dyspec import generate, load_pair
from dyspec.core.draft import DraftSession
from dyspec.core.kv import target_features
from dyspec.core.tree import Tree
from dyspec.drafts.eagle import load_eagle
from dyspec.errors import DyspecError
from dyspec.load.draft_spec import load_draft, parse_draft

from .tiny import (
    tiny_eagle3_pair,
    tiny_eagle_pair,
    tiny_model,
    tiny_tokenizer,
    write_eagle3_checkpoint,
    write_eagle_checkpoint,
)

PROMPT = [0, 3, 1, 2, 4]


def rms(x, weight, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def rope(x, positions, theta=10000.0):
    """x [n, heads, d] rotated as Llama does (the halves paired, rotate_half)."""
    d = x.shape[-1]
    freqs = positions[:, None].float() / theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def attention(x: torch.Tensor, w: dict, p: str, config) -> torch.Tensor:
    """Llama attention of the layer whose weights start with `p` over x [n, *], causal, positions 0..n-1."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d, n = config.hidden_size // heads, len(x)
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, d)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, d)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, d)
    q, k = rope(q, torch.arange(n)), rope(k, torch.arange(n))
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return (
        torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d) @ w[p + "self_attn.o_proj.weight"].T
    )


def mlp_block(h: torch.Tensor, w: dict, p: str, eps: float) -> torch.Tensor:
    """h plus the layer's MLP of its post-attention norm."""
    m = rms(h, w[p + "post_attention_layernorm.weight"], eps)
    return (
        h
        + (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T))
        @ w[p + "mlp.down_proj.weight"].T
    )


def eagle_reference(w: dict, target, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
    """EAGLE-1's draft, from its equations: x = fc([embedding; feature]), one Llama layer whose input
    is not normed, the target's output layer on its output. Logits [n, V] of a causal pass."""
    config = target.config
    x = torch.cat([w["embed_tokens.weight"][tokens], features], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
    x = x + attention(x, w, "layers.0.", config)
    return mlp_block(x, w, "layers.0.", config.rms_norm_eps) @ target.lm_head.weight.T


def features_of(target, tokens: list[int]) -> torch.Tensor:
    """The target's final hidden states (after its final norm) at `tokens`, [n, H]."""
    hidden = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return target_features(hidden, (-1,))[0]


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.safetensors"])
@pytest.mark.parametrize("bias", [True, False])
@torch.no_grad()
def test_an_eagle_draft_computes_eagles_equations(tmp_path, weights, bias):
    target = tiny_model(1, 2)
    w = write_eagle_checkpoint(tmp_path, target, bias=bias, weights=weights)
    draft = load_draft(parse_draft(f"eagle:{tmp_path}", "tiny-target"), target, tiny_tokenizer(), False)
    tokens, features = PROMPT[1:], features_of(target, PROMPT)[:-1]  # token j reads the state at j - 1
    expected = eagle_reference(w, target, tokens, features)
    got = draft(torch.tensor([tokens]), torch.arange(len(tokens))[None], input_features=features[None]).logits[0]
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    # the same tensors read with the fc's halves in dyspec's own order ([feature; embedding]) are not EAGLE's
    swapped = dict(w, **{"fc.weight": torch.cat([w["fc.weight"][:, 32:], w["fc.weight"][:, :32]], 1)})
    assert not torch.allclose(eagle_reference(swapped, target, tokens, features), got, atol=1e-2)


@torch.no_grad()
def test_the_draft_session_skips_the_first_token_as_eagle_does(tmp_path):
    """EAGLE's draft never reads the first token (no state comes before it): the session's first
    forward is the prompt from its second token, each reading the target's state before it."""
    pair = tiny_eagle_pair(tmp_path)
    w = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    session = DraftSession(pair.draft, PROMPT)
    session.set_prompt_features(features_of(pair.target, PROMPT)[:-1])
    root = session.logits(Tree.root(PROMPT[-1]), [0])[0]
    expected = eagle_reference(w, pair.target, PROMPT[1:], features_of(pair.target, PROMPT)[:-1])[-1]
    assert torch.allclose(root, expected, atol=1e-4)


def edit(folder, config=None, rename=None):
    if config:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if rename:
        w = torch.load(folder / "pytorch_model.bin", weights_only=True)
        old, new = rename
        w[new] = w.pop(old)
        torch.save(w, folder / "pytorch_model.bin")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"config": {"hidden_size": 64}}, "hidden_size 64 \\(the target's: 32\\)"),
        ({"config": {"vocab_size": 7}}, "vocab_size 7"),
        ({"rename": ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.qproj.weight")}, "q_proj"),
        ({"rename": ("fc.weight", "fc1.weight")}, "no fc.weight"),
        ({"config": {"bias": False}}, "fc.bias"),  # a bias the config says is not there
    ],
)
def test_a_checkpoint_that_does_not_fit_is_a_clear_error(tmp_path, change, message):
    target = tiny_model(1, 2)
    write_eagle_checkpoint(tmp_path, target)
    edit(tmp_path, **change)
    with pytest.raises(DyspecError, match=message):
        load_eagle(tmp_path, target)


def test_a_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(DyspecError, match="not found"):
        load_draft(parse_draft(f"eagle:{tmp_path / 'none'}", "t"), tiny_model(1, 2), tiny_tokenizer(), False)
    with pytest.raises(DyspecError, match="not in the local Hugging Face cache"):
        load_draft(parse_draft("eagle:nobody/no-such-draft", "t"), tiny_model(1, 2), tiny_tokenizer(), False)


CASES = [
    ("chain", 4, {}),
    ("dyspec", 8, {}),
    ("sequoia", 8, {"acceptance": [0.5, 0.2]}),
    ("specinfer", 6, {"expansion": "2,2"}),
    ("eagle2", 6, {"topk": 2, "depth": 3}),
    ("sglang", 6, {"topk": 2, "steps": 2}),
]


@pytest.mark.parametrize("policy,budget,options", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("make_pair", [tiny_eagle_pair, tiny_eagle3_pair], ids=["eagle", "eagle3"])
def test_an_eagle_draft_is_greedy_exact(tmp_path, make_pair, policy, budget, options):
    pair = make_pair(tmp_path)
    ar = generate(pair, PROMPT, policy="ar", max_new_tokens=30).token_ids
    r = generate(pair, PROMPT, policy=policy, budget=budget, max_new_tokens=30, options=options)
    assert r.token_ids == ar and r.draft_forwards > 0


def eagle3_reference(w: dict, target, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's draft, from its equations: g = fc([low; mid; high]), attention over
    [norm_in(embedding); norm_h(g)] with its residual on g, the MLP, then lm_head(norm(h)) over its
    own vocabulary, draft token d being target token d + d2t[d]. Full-vocabulary logits [n, V]."""
    config, eps, p = target.config, target.config.rms_norm_eps, "midlayer."
    g = features @ w["fc.weight"].T
    e = w["embed_tokens.weight"][tokens]
    x = torch.cat([rms(e, w[p + "input_layernorm.weight"], eps), rms(g, w[p + "hidden_norm.weight"], eps)], -1)
    h = mlp_block(g + attention(x, w, p, config), w, p, eps)
    logits = torch.full((len(tokens), config.vocab_size), float("-inf"))
    logits[:, torch.arange(len(w["d2t"])) + w["d2t"]] = rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T
    return logits


def eagle3_features(target, tokens: list[int]) -> torch.Tensor:
    """The inputs of layers 2, L // 2 and L - 3 (not normed), concatenated: what EAGLE-3 fuses."""
    hidden = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    L = target.config.num_hidden_layers
    return torch.cat([hidden[2], hidden[L // 2], hidden[L - 3]], -1)[0]


@torch.no_grad()
def test_an_eagle3_draft_computes_eagle3s_equations(tmp_path):
    target = tiny_model(1, 8)
    w = write_eagle3_checkpoint(tmp_path, target)
    draft = load_draft(parse_draft(f"eagle:{tmp_path}", "tiny-target"), target, tiny_tokenizer(), False)
    assert draft.feature_layers == (2, 4, 5)
    tokens, features = PROMPT[1:], eagle3_features(target, PROMPT)[:-1]
    expected = eagle3_reference(w, target, tokens, features)
    got = draft(torch.tensor([tokens]), torch.arange(len(tokens))[None], input_features=features[None]).logits[0]
    assert torch.equal(torch.isinf(got), torch.isinf(expected))  # token 3 is outside its vocabulary
    assert torch.allclose(got[:, [0, 1, 2, 4]], expected[:, [0, 1, 2, 4]], atol=1e-4)
    # the three layers fused in another order are not EAGLE-3's
    low, mid, high = features.chunk(3, -1)
    shuffled = eagle3_reference(w, target, tokens, torch.cat([high, mid, low], -1))
    assert not torch.allclose(shuffled[:, [0, 1, 2, 4]], got[:, [0, 1, 2, 4]], atol=1e-2)
    # in a session, the engine feeds it those very layers, from the prompt's second token
    session = DraftSession(draft, PROMPT)
    hidden = target(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    session.set_prompt_features(target_features(hidden, draft.feature_layers)[0][:-1])
    root = session.logits(Tree.root(PROMPT[-1]), [0])[0]  # over its own vocabulary
    assert session.vocab.ids.tolist() == [0, 1, 2, 4]
    assert torch.allclose(root, expected[-1, [0, 1, 2, 4]], atol=1e-4)


@pytest.mark.parametrize(
    "rename,message",
    [(("midlayer.hidden_norm.weight", "midlayer.hiddennorm.weight"), "hidden_norm"), (("d2t", "d2t_"), "d2t")],
)
def test_an_eagle3_checkpoint_that_does_not_fit_is_a_clear_error(tmp_path, rename, message):
    from safetensors.torch import load_file, save_file

    target = tiny_model(1, 8)
    write_eagle3_checkpoint(tmp_path, target)
    w = load_file(tmp_path / "model.safetensors")
    w[rename[1]] = w.pop(rename[0])
    save_file(w, tmp_path / "model.safetensors")
    with pytest.raises(DyspecError, match=message):
        load_eagle(tmp_path, target)


@pytest.mark.parametrize("write", [write_eagle_checkpoint, write_eagle3_checkpoint], ids=["eagle", "eagle3"])
def test_an_eagle_draft_runs_beside_the_default_target(default_pair, tmp_path, write):
    """`--draft eagle:PATH` through `load_pair`, as a user runs it on a CPU: the int8 target on the
    compiled forward, the draft in int8 too; greedy output identical to `ar`."""
    write(tmp_path, default_pair.target)
    pair = load_pair(draft=f"eagle:{tmp_path}")
    assert pair.precision == "int8" and pair.fast_path == "compiled" and pair.draft_name == f"eagle:{tmp_path}"
    prompt = "List three tips for staying focused while studying."
    ar = generate(pair, prompt, policy="ar", max_new_tokens=16).token_ids
    r = generate(pair, prompt, policy="dyspec", budget=8, max_new_tokens=16)
    assert r.token_ids == ar and r.draft_forwards > 0
