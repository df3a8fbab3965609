"""Published Medusa heads (`--draft medusa:PATH`): read from a checkpoint written in FasterDecoding/Medusa's
layout, checked against Medusa's equations written out here, and exact under every tree policy."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from dyspec import generate, load_pair
from dyspec.core.draft import DraftSession
from dyspec.core.tree import Tree
from dyspec.drafts.medusa import load_medusa
from dyspec.errors import DyspecError
from dyspec.load.draft_spec import load_draft, parse_draft

from .test_eagle import CASES, features_of
from .tiny import tiny_medusa_pair, tiny_model, tiny_tokenizer, write_medusa_checkpoint

PROMPT = [0, 3, 1, 2, 4]


def medusa_reference(w: dict, k: int, layers: int, h: torch.Tensor) -> torch.Tensor:
    """Head k's logits from Medusa's equations: `layers` blocks x + SiLU(A x + b), then W_k."""
    x = h
    for j in range(layers):
        x = x + F.silu(x @ w[f"{k}.{j}.linear.weight"].T + w[f"{k}.{j}.linear.bias"])
    return x @ w[f"{k}.{layers}.weight"].T


def load(folder, target):
    return load_draft(parse_draft(f"medusa:{folder}", "tiny-target"), target, tiny_tokenizer(), False)


@pytest.mark.parametrize("weights", ["medusa_lm_head.safetensors", "medusa_lm_head.pt"])
@pytest.mark.parametrize("layers", [1, 2])
@torch.no_grad()
def test_medusa_heads_compute_medusas_equations(tmp_path, weights, layers):
    target = tiny_model(1, 2)
    w = write_medusa_checkpoint(tmp_path, target, layers=layers, weights=weights)
    draft = load(tmp_path, target)
    h = features_of(target, PROMPT)
    # the target's features (a root's): head 0
    got = draft(torch.tensor([PROMPT]), input_features=h[None]).logits[0]
    assert torch.allclose(got, medusa_reference(w, 0, layers, h), atol=1e-5)
    # its own features carry the depth: head k at depth k, uniform past the last head
    for depth in range(4):
        own = torch.cat([h, torch.full((len(h), 1), float(depth))], -1)
        out = draft(torch.tensor([PROMPT]), input_features=own[None])
        expected = medusa_reference(w, depth, layers, h) if depth < 3 else torch.zeros(len(h), 5)
        assert torch.allclose(out.logits[0], expected, atol=1e-5)
        assert torch.equal(out.hidden_states[-1][0], torch.cat([h, torch.full((len(h), 1), depth + 1.0)], -1))
    # the heads in another order are not these
    assert not torch.allclose(medusa_reference(w, 1, layers, h), got, atol=1e-2)


@torch.no_grad()
def test_a_session_drafts_head_k_at_depth_k_whatever_the_path(tmp_path):
    """The root (the target's sampled token) gets head 0 of the state before it; a node at depth k
    head k of that same state, whichever tokens its path holds."""
    pair = tiny_medusa_pair(tmp_path)
    w = json.loads((tmp_path / "config.json").read_text())
    assert w["medusa_num_heads"] == 3
    from safetensors.torch import load_file

    w = load_file(tmp_path / "medusa_lm_head.safetensors")
    h = features_of(pair.target, PROMPT)
    session = DraftSession(pair.draft, PROMPT)
    session.set_prompt_features(h[:-1])
    tree = Tree.root(PROMPT[-1])
    root = session.logits(tree, [0])[0]
    assert torch.allclose(root, medusa_reference(w, 0, 1, h[-2]), atol=1e-5)
    a, b = tree.add(0, 1, 0.5), tree.add(0, 2, 0.3)
    a_logits, b_logits = session.logits(tree, [a, b])
    c = tree.add(a, 4, 0.2)  # a feature draft's node reads its parent's output: the parent comes first
    (c_logits,) = session.logits(tree, [c])
    assert torch.equal(a_logits, b_logits)
    assert torch.allclose(a_logits, medusa_reference(w, 1, 1, h[-2]), atol=1e-5)
    assert torch.allclose(c_logits, medusa_reference(w, 2, 1, h[-2]), atol=1e-5)


def rewrite(folder, config=None, rename=None, shape=None):
    from safetensors.torch import load_file, save_file

    if config:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    w = load_file(folder / "medusa_lm_head.safetensors")
    if rename:
        w[rename[1]] = w.pop(rename[0])
    if shape:
        w = {k: torch.cat([v, v]) if k.endswith(".1.weight") else v for k, v in w.items()}  # 10 output rows
    save_file(w, folder / "medusa_lm_head.safetensors")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"config": {"medusa_num_heads": 4}}, "config.json says 4 heads of 1 blocks; the weights hold 3 of 1"),
        ({"rename": ("1.1.weight", "1.1.wieght")}, "1.1.weight"),
        ({"shape": True}, "5 tokens.*torch.Size\\(\\[10, 32\\]\\)"),
        ({"rename": ("0.0.linear.weight", "head.linear.weight")}, "head.linear.weight"),
    ],
)
def test_heads_that_do_not_fit_are_a_clear_error(tmp_path, change, message):
    target = tiny_model(1, 2)
    write_medusa_checkpoint(tmp_path, target)
    rewrite(tmp_path, **change)
    with pytest.raises(DyspecError, match=message):
        load_medusa(tmp_path, target)


def test_heads_for_another_target_and_missing_heads_are_a_clear_error(tmp_path):
    wide = tiny_model(1, 2)
    wide.config.hidden_size = 64  # the heads are written for this shape
    write_medusa_checkpoint(tmp_path / "wide", type("T", (), {"config": wide.config})())
    with pytest.raises(DyspecError, match="hidden size 32, 5 tokens"):
        load_medusa(tmp_path / "wide", tiny_model(1, 2))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DyspecError, match="holds no Medusa weights"):
        load_medusa(tmp_path / "empty", tiny_model(1, 2))
    with pytest.raises(DyspecError, match="Medusa checkpoint not found"):
        load(tmp_path / "none", tiny_model(1, 2))


@pytest.mark.parametrize("policy,budget,options", CASES, ids=lambda x: str(x))
def test_medusa_heads_are_greedy_exact(tmp_path, policy, budget, options):
    pair = tiny_medusa_pair(tmp_path)
    ar = generate(pair, PROMPT, policy="ar", max_new_tokens=30).token_ids
    r = generate(pair, PROMPT, policy=policy, budget=budget, max_new_tokens=30, options=options)
    assert r.token_ids == ar and r.draft_forwards > 0


def test_medusa_heads_run_beside_the_default_target(default_pair, tmp_path):
    """`--draft medusa:PATH` through `load_pair`, as a user runs it on a CPU: the int8 target on the
    compiled forward, the heads in int8 too; greedy output identical to `ar`."""
    write_medusa_checkpoint(tmp_path, default_pair.target, heads=2)
    pair = load_pair(draft=f"medusa:{tmp_path}")
    assert pair.precision == "int8" and pair.fast_path == "compiled" and pair.draft_name == f"medusa:{tmp_path}"
    prompt = "List three tips for staying focused while studying."
    ar = generate(pair, prompt, policy="ar", max_new_tokens=16).token_ids
    r = generate(pair, prompt, policy="dyspec", budget=8, max_new_tokens=16)
    assert r.token_ids == ar and r.draft_forwards > 0


def test_medusa_heads_run_on_the_static_path(tmp_path):
    """Heads keep no cache: on the static path the target's cache is static and theirs stays none."""
    pair = dataclasses.replace(tiny_medusa_pair(tmp_path), fast_path="static")
    ar = generate(pair, PROMPT, policy="ar", max_new_tokens=20).token_ids
    assert generate(pair, PROMPT, policy="dyspec", budget=8, max_new_tokens=20).token_ids == ar
