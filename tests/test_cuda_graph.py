"""Lean forwards replayed as CUDA graphs (dyspec.forward.cuda_graph). On a CPU the same logic runs
without recording: fixed tensors per bucket, the slots written as a tensor, the mask over the whole
cache. On a GPU the graphs are recorded and replayed."""

import dataclasses

import pytest
import torch

from dyspec import generate
from dyspec.eval.anatomy import step_counts
from dyspec.forward import lean as lean_module
from dyspec.forward.choose import choose_forward
from dyspec.forward.cuda_graph import GraphForward
from dyspec.forward.lean import LeanForward
from dyspec.kernels import row_attention

from .test_engine import GREEDY_CASES
from .test_lean import ARCHITECTURES, random_tree
from .tiny import tiny_feature_pair, tiny_pair

PROMPT = [0, 3, 1, 2]
CASES = [
    ("ar", 1, {}),
    ("chain", 4, {}),
    ("dyspec", 6, {}),
    ("sequoia", 8, {"acceptance": [0.3, 0.1, 0.05]}),
    ("specinfer", 10, {"expansion": "2,2,1"}),
    ("eagle2", 12, {}),
    # the step on the device: its tensors into the bucketed forwards, whose padding leaves gaps between slots
    ("chain", 4, {"step": "device"}),
    ("dyspec", 6, {"step": "device"}),
    ("dyspec", 10, {"step": "device", "batch": 3}),
    ("sequoia", 8, {"acceptance": [0.3, 0.1, 0.05], "step": "device"}),
    ("eagle2", 12, {"step": "device"}),
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


def graph_and_eager(model, prompt: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Logits of a tree forward after `prompt` and the first layer's keys, on the eager lean forward
    and on the graph path (slots as a tensor, the mask over the whole cache)."""
    tree = random_tree(prompt[-1], model.config.vocab_size)
    outs = []
    for forward in (choose_forward(model, "lean"), GraphForward(LeanForward(model))):
        kv = forward.session("check", 64, (1, 2, 4, 16), last_only=(False, True))
        kv.append(prompt)
        logits = kv.forward(tree.tokens, [kv.length + d for d in tree.depths], tree.ancestor_mask())
        outs.append((logits[: len(tree)], kv.cache.layers[0].keys[0, :, : kv.length + len(tree)]))
    return outs


@pytest.mark.parametrize("model", ARCHITECTURES, ids=["llama", "mistral", "qwen2", "qwen3"])
def test_the_graph_layers_compute_the_eager_lean_layers(model):
    """Every covered architecture (q/k/v biases, q/k norms) on the graph path's layers: the keys the
    eager lean forward writes, at the same slots, and its logits."""
    torch.manual_seed(0)
    model = model().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    (eager, eager_keys), (graphed, graphed_keys) = graph_and_eager(model, [1, 4, 2, 3, 0, 4, 4, 1])
    torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=0)
    torch.testing.assert_close(graphed_keys, eager_keys, atol=1e-6, rtol=0)


def test_one_compiled_graph_layer_serves_every_layer_and_size(monkeypatch):
    """On a GPU each layer runs `graph_layer` compiled: here Inductor compiles it for the CPU, with
    the same results as the eager function, compiled twice (one row, then any number of rows) for
    all layers and bucket sizes of a model, not once per layer or size."""
    torch._dynamo.reset()
    monkeypatch.setattr(lean_module, "has_triton", lambda: True)  # Inductor compiles for a CPU without it
    lean_module.compiled_graph_layer.cache_clear()
    monkeypatch.setattr(lean_module, "graph_layer", lean_module.compiled_graph_layer())
    lean_module.compiled_graph_layer.cache_clear()
    model = tiny_pair().target
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    (eager, _), (compiled, _) = graph_and_eager(model, PROMPT)
    generate(graph_pair(tiny_pair()), PROMPT, policy="dyspec", budget=6, max_new_tokens=12)
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] - before <= 2
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=0)


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


def test_a_step_on_the_device_on_the_graph_path_reads_once_and_dispatches_few_ops(monkeypatch):
    """The GPU's graph path, its logic run here: a `dyspec:step=device` step at 16 reads the host
    once and dispatches at most 70 ops outside the forwards (each a launch on a GPU), its commit by
    tensor ops as there (no CPU kernel): each forward's mask one program over the padded bucket,
    its outputs copied out of the graph by one more, the commit a few ops for all layers (129
    before the mask and the copies were programs)."""
    monkeypatch.setattr(row_attention, "kernel_available", lambda: False)
    counts = step_counts(graph_pair(tiny_feature_pair()), PROMPT, "dyspec", 16, 40, options={"step": "device"})
    assert counts["steps"] > 5 and counts["reads"] == 1
    assert counts["ops"] <= 70, counts
