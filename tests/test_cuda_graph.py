"""Lean forwards replayed as CUDA graphs (dyspec.forward.cuda_graph). On a CPU the same logic runs
without recording: fixed tensors per bucket, the slots written as a tensor, the mask over the whole
cache. On a GPU the graphs are recorded and replayed."""

import dataclasses

import pytest
import torch

from dyspec import generate
from dyspec.forward.choose import choose_forward
from dyspec.forward.cuda_graph import GraphForward
from dyspec.forward.lean import LeanForward

from .test_engine import GREEDY_CASES
from .tiny import tiny_feature_pair, tiny_pair

PROMPT = [0, 3, 1, 2]
CASES = [
    ("ar", 1, {}),
    ("chain", 4, {}),
    ("dyspec", 6, {}),
    ("sequoia", 8, {"acceptance": [0.3, 0.1, 0.05]}),
    ("specinfer", 10, {"expansion": "2,2,1"}),
    ("eagle2", 12, {}),
]


def graph_pair(pair):
    """`pair` with its target and draft on the graph path, as `choose_forward` puts them on a GPU."""
    graphed = dataclasses.replace(pair, fast_path="compiled", forwards={})
    graphed.forwards[("compiled", id(pair.target))] = GraphForward(LeanForward(pair.target))
    if getattr(pair.draft, "runs_lean", False):
        pair.draft.use_lean()
        graphed.forwards[("compiled", id(pair.draft))] = GraphForward(pair.draft)
    else:
        graphed.forwards[("compiled", id(pair.draft))] = GraphForward(LeanForward(pair.draft))
    return graphed


@pytest.mark.parametrize("make", [tiny_pair, tiny_feature_pair])
def test_greedy_on_the_graph_path_is_token_identical_to_ar(make):
    pair = make()
    expected = generate(pair, PROMPT, policy="ar", max_new_tokens=40).token_ids
    graphed = graph_pair(pair)
    for policy, budget, options in CASES:
        got = generate(graphed, PROMPT, policy=policy, budget=budget, max_new_tokens=40, options=options).token_ids
        assert got == expected, policy


def test_forwards_are_recorded_once_per_bucket_and_kept_between_generations():
    graphed = graph_pair(tiny_feature_pair())
    generate(graphed, PROMPT, policy="dyspec", budget=6, max_new_tokens=20)
    target = graphed.forward(graphed.target).held["target"]
    recorded = dict(target.run.recorded)
    # one recording per bucket and kind of output, up to the bucket that holds the budget's tree
    assert {rec.inputs["input_ids"].shape[1] for rec in recorded.values()} == {1, 2, 4, 8}
    generate(graphed, PROMPT, policy="dyspec", budget=6, max_new_tokens=20)
    assert graphed.forward(graphed.target).held["target"] is target
    assert target.run.recorded == recorded


def test_the_slots_of_a_graph_forward_write_where_the_eager_forward_writes():
    """A forward at slots given as a tensor over the whole cache: the same keys, values and logits as
    the eager lean forward at the same slots."""
    pair = tiny_pair()
    eager, graphed = choose_forward(pair.target, "lean"), GraphForward(LeanForward(pair.target))
    outs = []
    for forward in (eager, graphed):
        kv = forward.session("check", 64, (1, 2, 4), last_only=(False, True))
        kv.append(PROMPT)
        tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        logits = kv.forward([1, 2, 3], [4, 5, 5], tree)
        keys = kv.cache.layers[0].keys[0, :, : kv.cached]
        outs.append((logits, keys))
    assert torch.allclose(outs[0][0], outs[1][0][:3], atol=1e-5)
    assert torch.allclose(outs[0][1], outs[1][1][:, :7], atol=1e-6)


def test_choose_forward_puts_lean_models_on_graphs_on_a_gpu_only():
    pair = tiny_feature_pair()
    assert not isinstance(choose_forward(pair.target, "compiled"), GraphForward)  # a CPU: the static path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graphs_on_a_gpu_replay_and_stay_exact_in_fp32():
    from dyspec.load import load_pair

    pair = load_pair(precision="fp32", fast_path="compiled")
    assert isinstance(pair.forward(pair.target), GraphForward)
    expected = generate(pair, "Name three colours.", policy="ar", max_new_tokens=32).token_ids
    for policy, budget, options in GREEDY_CASES:
        got = generate(pair, "Name three colours.", policy=policy, budget=budget, max_new_tokens=32, options=options)
        assert got.token_ids == expected, policy
