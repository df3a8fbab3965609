"""The row-invariant kernels of the GPU forward (dyspec.kernels.invariant, DYSPEC_GPU_KERNELS=invariant),
run on the CPU by Triton's interpreter: each row computes what it computes alone, bit for bit, so a
tree row's logits are the one-row forward's of its path, and the graph path's trees keep `ar`'s
tokens. On a GPU the same in bf16 (the last test)."""

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

from dyspec import generate
from dyspec.forward.cuda_graph import GraphForward
from dyspec.forward.lean import LeanForward

from .test_cuda_graph import graph_pair
from .test_engine import GREEDY_CASES
from .test_lean import random_tree
from .tiny import tiny_feature_pair, tiny_model

pytest.importorskip("triton")
PROMPT = [0, 3, 1, 2, 4, 4, 1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where a GPU is, the kernels run compiled there


@pytest.fixture
def kernels(monkeypatch):
    """The kernels, compiled on a GPU or on a CPU in Triton's interpreter (conftest asks for it), and
    the graph path asked to run them."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's kernels run on a CPU in its interpreter only (TRITON_INTERPRET=1)")
    monkeypatch.setenv("DYSPEC_GPU_KERNELS", "invariant")
    return importlib.import_module("dyspec.kernels.invariant")


@pytest.mark.parametrize("rows", [1, 5, 37])
def test_products_and_norms_compute_each_row_as_it_does_alone(kernels, rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(*shape, generator=g).to(DEVICE) for shape in ((rows, 80), (96, 80), (96,)))
    y = kernels.linear(x, w, b)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    norm = torch.randn(80, generator=g).to(DEVICE)
    z = kernels.rms_norm(x, (80,), norm, 1e-5)
    torch.testing.assert_close(z, F.rms_norm(x, (80,), norm, 1e-5), atol=1e-5, rtol=1e-5)
    for i in range(rows):
        assert torch.equal(kernels.linear(x[i : i + 1], w, b)[0], y[i])
        assert torch.equal(kernels.rms_norm(x[i : i + 1], (80,), norm, 1e-5)[0], z[i])


def test_a_rows_attention_over_scattered_slots_is_the_one_row_attention_over_them_in_a_row(kernels):
    """A tree row sees the prefix and its ancestors, slots with gaps between them; after a commit the
    one-row forward sees the same keys side by side: the same sums in the same order."""
    g = torch.Generator().manual_seed(0)
    kv_heads, capacity, d, heads = 2, 150, 8, 6
    keys, values, q = (
        torch.randn(*shape, generator=g).to(DEVICE) for shape in [(kv_heads, capacity, d)] * 2 + [(5, heads, d)]
    )
    visible = (torch.rand(5, capacity, generator=g) < 0.4).to(DEVICE)
    visible[:, 0] = True
    out = kernels.attention(q, keys, values, kernels.visible_slots(visible), 0.3)
    scores = torch.einsum("nhd,hsd->nhs", q, keys.repeat_interleave(3, 0)) * 0.3
    p = scores.masked_fill(~visible[:, None], -torch.inf).softmax(-1)
    reference = torch.einsum("nhs,hsd->nhd", p, values.repeat_interleave(3, 0)).reshape(5, heads * d)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    for r in range(5):
        seen = visible[r].nonzero()[:, 0]
        packed_k, packed_v = torch.zeros_like(keys), torch.zeros_like(values)
        packed_k[:, : len(seen)], packed_v[:, : len(seen)] = keys[:, seen], values[:, seen]
        in_a_row = torch.arange(capacity, device=DEVICE)[None] < len(seen)
        alone = kernels.attention(q[r : r + 1], packed_k, packed_v, kernels.visible_slots(in_a_row), 0.3)
        assert torch.equal(alone[0], out[r])


def test_a_tree_rows_logits_are_the_one_row_forwards_of_its_path(kernels):
    """On the graph path (the GPU's, run here as on a CPU): a token tree in one forward, then each
    node's token forwarded alone after its path committed one token at a time, as `ar` does."""
    model = tiny_model(3, 2).to(DEVICE)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    tree = random_tree(PROMPT[-1], model.config.vocab_size, size=11)
    forward = GraphForward(LeanForward(model))

    def session():
        kv = forward.session("check", 64, (1, 16), last_only=(False, True))
        kv.append(PROMPT)
        return kv

    kv = session()
    rows = kv.forward(tree.tokens, [kv.length + d for d in tree.depths], tree.ancestor_mask())
    for node in range(len(tree)):
        kv = session()
        path = [0, *tree.path(node)]
        for a in path[:-1]:
            kv.append([tree.tokens[a]])
        assert torch.equal(kv.forward([tree.tokens[node]])[0], rows[node]), node


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny pair runs on a CPU: on a GPU, the test below")
def test_trees_on_the_invariant_graph_path_keep_ars_tokens(kernels):
    graphed = graph_pair(tiny_feature_pair())
    expected = generate(graphed, PROMPT, policy="ar", max_new_tokens=12).token_ids
    for policy, budget, options in [("dyspec", 6, {}), ("chain", 4, {"step": "device"})]:
        got = generate(graphed, PROMPT, policy=policy, budget=budget, max_new_tokens=12, options=options)
        assert got.token_ids == expected, policy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_bf16_trees_keep_ars_tokens(monkeypatch):
    from dyspec.load import load_pair

    monkeypatch.setenv("DYSPEC_GPU_KERNELS", "invariant")
    pair = load_pair(fast_path="compiled")
    assert pair.target.dtype == torch.bfloat16 and isinstance(pair.forward(pair.target), GraphForward)
    expected = generate(pair, "Name three colours.", policy="ar", max_new_tokens=32).token_ids
    for policy, budget, options in GREEDY_CASES:
        got = generate(pair, "Name three colours.", policy=policy, budget=budget, max_new_tokens=32, options=options)
        assert got.token_ids == expected, policy
