"""The compiled int8 lean forward (`--fast-path compiled` on a CPU, dyspec.forward.lean_graph): a tree
row is bit for bit the one-token forward of its path, its logits are as close to the fp32 model's
as the eager int8 forward's are, and every policy is greedy-identical to `ar` on it."""

import pytest
import torch

from dyspec import generate
from dyspec.core.kv import KVSession
from dyspec.forward import attention, lean_graph
from dyspec.forward.choose import choose_forward
from dyspec.forward.lean import LeanForward
from dyspec.forward.quant import Int8Linear, quantize_int8
from dyspec.load.pair import ModelPair

from .conftest import PROMPTS
from .test_lean import random_tree
from .tiny import fresh_cache, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the int8 path runs on a CPU only")
PROMPT = [int(t) for t in torch.randint(5, (60,), generator=torch.Generator().manual_seed(0))]


def tiny_int8(seed: int = 1, layers: int = 2):
    model = quantize_int8(tiny_model(seed, layers))
    model.set_attn_implementation(attention.NAME)
    return model


def compiled_forward(model) -> LeanForward:
    """What `--fast-path compiled` runs an int8 model on, its layers compiled."""
    forward = choose_forward(model, "compiled")
    forward.session("warm-up", 1)  # compiles the layers
    return forward.run


@pytest.fixture(scope="module")
def compiled():
    """The tiny target in int8 and its compiled lean forward."""
    model = tiny_int8()
    return model, compiled_forward(model)


def session(run) -> KVSession:
    return KVSession(run, cache=run.cache_for("test"))


@torch.inference_mode()
def test_a_tree_row_is_the_one_token_forward_of_its_path(compiled):
    """Bit for bit, in a tree whose rows see 61 to 66 keys, and in a tree forward of one row."""
    _, run = compiled
    assert run.graph is not None
    tree = random_tree(PROMPT[-1], 5, size=12, seed=3)
    kv = session(run)
    kv.append(PROMPT[:-1])
    logits = kv.forward(tree.tokens, [kv.length + d for d in tree.depths], tree.ancestor_mask())
    for node in range(len(tree)):
        one = session(run)
        one.append(PROMPT[:-1])
        for a in [0, *tree.path(node)]:
            row = one.forward([tree.tokens[a]])[0]
            one.commit([one.length])
        assert torch.equal(logits[node], row), node
    lone = session(run)
    lone.append(PROMPT[:-1])
    assert torch.equal(lone.forward([PROMPT[-1]], visible=torch.ones(1, 1, dtype=torch.bool))[0], logits[0])


def test_a_saved_graph_loads_as_the_graph_it_was(monkeypatch, tmp_path):
    """Outside tests (no CHECK_GUARDS) a block's graphs are saved in the cache folder and a model of
    the same shapes in a later process loads them instead of compiling, and in the same process runs
    them: the same logits bit for bit, at other sizes than they were compiled at. 7 layers: a block
    of 5 and a last block of 2, a graph each, and the output rows' graph."""
    monkeypatch.setattr(lean_graph, "CHECK_GUARDS", False)
    monkeypatch.setattr(lean_graph, "GRAPHS", {})
    fresh_cache(monkeypatch, tmp_path)
    loaded = []
    load = lean_graph.load_graph
    monkeypatch.setattr(lean_graph, "load_graph", lambda path: loaded.append(load(path)) or loaded[-1])
    logits = []
    for later_process in (False, True, False):
        if later_process:
            lean_graph.GRAPHS.clear()
        run = compiled_forward(tiny_int8(layers=7))
        kv = session(run)
        kv.append(PROMPT[:45])
        tree = random_tree(PROMPT[45], 5, size=9, seed=4)
        rows = kv.forward(tree.tokens, [kv.length + d for d in tree.depths], tree.ancestor_mask())
        kv.commit([kv.length])
        logits.append(torch.cat([rows, kv.forward([PROMPT[46]])]))
    # (prompt, row, tree) x 2 block lengths, and the output rows' (row, tree: a prompt's is a tree's)
    assert [x is None for x in loaded] == [True] * 8 + [False] * 8  # none loaded by the third model
    assert len(list((tmp_path / "graphs").iterdir())) == 8
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def error_from_fp32(model, fp32, prompt: list[int]) -> float:
    """Max |logits - the fp32 model's| over a prefill and 8 one-token steps of `prompt`'s tail."""
    kv, worst = KVSession(model, cache=model.cache_for("error")), 0.0
    kv.append(prompt[:-8])
    with torch.inference_mode():
        for i in range(len(prompt) - 8, len(prompt)):
            got = kv.append([prompt[i]])[0]
            want = fp32(torch.tensor([prompt[: i + 1]])).logits[0, -1]
            worst = max(worst, float((got - want).abs().max()))
    return worst


def sharp_attention(model):
    """The tiny model with its queries and keys scaled 16x: at its init attention is near uniform, so
    positions (and a wrong rotary) would barely move its logits."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(16)
            layer.self_attn.k_proj.weight.mul_(16)
    return model


def test_compiled_logits_are_as_close_to_fp32_as_eager_int8s():
    """Its own activation quantization rounds other values than the eager int8 forward's, so the two
    int8 models differ in the last bits; each is held to the fp32 model it approximates: the
    compiled forward's distance from it (a prompt, then one-token steps) within 1.5x the eager int8
    forward's (measured 1.3x). A rotary that drops its sine half is caught (measured 16x)."""

    def int8():
        model = quantize_int8(sharp_attention(tiny_model(1, 2)))
        model.set_attn_implementation(attention.NAME)
        return model

    fp32, eager, run = sharp_attention(tiny_model(1, 2)), LeanForward(int8()), compiled_forward(int8())
    eager_error, compiled_error = error_from_fp32(eager, fp32, PROMPT), error_from_fp32(run, fp32, PROMPT)
    assert 0 < compiled_error <= 1.5 * eager_error, (compiled_error, eager_error)
    run.sin = torch.zeros_like(run.sin)
    assert error_from_fp32(run, fp32, PROMPT) > 4 * eager_error


@pytest.mark.parametrize(
    "policy,budget,options",
    [("chain", 4, {}), ("dyspec", 8, {}), ("sequoia", 8, {"acceptance": [0.5, 0.2]}), ("lookup", 4, {})],
    ids=str,
)
def test_tiny_policies_are_greedy_exact_on_the_compiled_forward(compiled, policy, budget, options):
    model, _ = compiled
    pair = ModelPair(
        model,
        model,  # drafting for itself: every drafted token is accepted, on the compiled forward too
        tiny_tokenizer(),
        "tiny",
        "self",
        torch.device("cpu"),
        torch.float32,
        "int8",
        fast_path="compiled",
    )
    ar = generate(pair, PROMPT, policy="ar", max_new_tokens=40).token_ids
    r = generate(pair, PROMPT, policy=policy, budget=budget, max_new_tokens=40, options=options)
    assert r.token_ids == ar and r.tokens_per_forward > 1  # trees were verified, and some accepted


def test_the_default_pair_is_greedy_exact_on_the_compiled_forward(default_pair):
    """The CPU default: the int8 target compiled, and the shipped draft's layer and output rows too."""
    pair = default_pair
    assert pair.fast_path == "compiled" and pair.precision == "int8"
    expected = generate(pair, PROMPTS[0], policy="ar", max_new_tokens=32).token_ids
    assert generate(pair, PROMPTS[0], policy="dyspec", budget=8, max_new_tokens=32).token_ids == expected
    assert pair.draft.graph is not None


def test_the_compiled_draft_drafts_as_well_as_its_eager_forward(default_pair):
    """Its own activation rounding changes the draft's last bits, not what it proposes: a tree policy's
    tokens per forward with the compiled draft stays within 10% of the eager lean draft's (with its
    output rows shifted by one token it drafts far worse)."""
    pair, draft = default_pair, default_pair.draft

    def tokens_per_forward() -> float:
        return generate(pair, PROMPTS[1], policy="dyspec", budget=8, max_new_tokens=48).tokens_per_forward

    compiled = tokens_per_forward()
    graph, draft.graph = draft.graph, None
    try:
        eager = tokens_per_forward()
    finally:
        draft.graph = graph
    assert graph is not None and compiled >= 0.9 * eager > 0.9, (compiled, eager)
    head = graph.head
    try:
        graph.head = lean_graph.linear_operands(Int8Linear(draft.borrowed.head.roll(1, 0)))
        assert tokens_per_forward() < 0.9 * eager
    finally:
        graph.head = head


@torch.inference_mode()
def test_a_prompt_row_is_its_one_token_forward(compiled):
    """A prompt runs as its own graph (causal SDPA, oneDNN's products) and must give each row what
    one-token forwards give it: the same int8 model. Within 1e-5 (SDPA's sums run in another order;
    measured 1e-6 on logits of scale 10), which a prompt that attends to later tokens misses by far."""
    _, run = compiled
    whole = session(run).append(PROMPT)
    one = session(run)
    rows = [one.append([token])[0] for token in PROMPT]
    assert (whole - torch.stack(rows)).abs().max() < 1e-5


@torch.inference_mode()
def test_a_draft_forward_in_one_graph_is_its_layers_then_its_output_rows(default_pair, monkeypatch):
    """The compiled draft's decoding forwards run as one graph (`draft_block`: fc, layers, output
    rows); one row and a tree of three must give the features and logits its layers' graph and its
    output rows give one after the other (fc's sums may run in another order: within 1e-4 on
    logits of scale 10). A graph that reads the wrong embedding rows misses by far."""
    draft = default_pair.draft
    forward = default_pair.forward(draft)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(64, draft.config.hidden_size, generator=gen)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    calls = []

    def run() -> list[torch.Tensor]:
        kv = forward.session("test", 64, keep_hidden=True, draft_vocab=True)
        kv.append(PROMPT[:40], features=features[:40])
        calls.clear()  # of the session's warm-up
        out = [kv.forward([PROMPT[40]], features=features[40:41]), kv.hidden]
        kv.commit([40])
        out += [kv.forward(PROMPT[41:44], [41, 42, 42], tree, features=features[41:44]), kv.hidden]
        return out

    one_graph_draft = lean_graph.CompiledLayers.draft
    monkeypatch.setattr(lean_graph.CompiledLayers, "draft", lambda *a: calls.append(1) or one_graph_draft(*a))
    one_graph = run()
    assert len(calls) == 2  # both forwards ran as the one graph
    with monkeypatch.context() as m:
        m.setattr(type(draft), "reads_in_one_graph", lambda *_: False)
        reference = run()
    assert all((a - b).abs().max() < 1e-4 for a, b in zip(one_graph, reference))
    weight = draft.borrowed.embed.weight  # the target's: rolled in place and put back
    original = weight.clone()
    try:
        weight.copy_(original.roll(1, 0))
        assert (run()[0] - reference[0]).abs().max() > 1
    finally:
        weight.copy_(original)
