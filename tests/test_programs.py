"""The step on the device's programs compiled (dyspec.core.programs): where the pair's forward is
compiled (the CPU default, int8), each round of `dyspec`'s heap, the tree's copies, a draft
forward's inputs, greedy verification and the step's read table are one compiled program each; the
step stays exact and dispatches a few dozen ops where eager tensor code dispatches hundreds."""

import warnings

import pytest
import torch

from dyspec.core import programs
from dyspec.core.programs import program
from dyspec.decode.engine import generate
from dyspec.eval.anatomy import counting, step_counts
from dyspec.policies import chain, dyspec, dyspec_threshold, specdecpp

from .conftest import PROMPTS
from .test_tree_tensors import HiddenTable, TableDraft, grown_tree, random_head


@pytest.mark.parametrize(
    "policy, budget, options",
    [
        ("dyspec", 4, {}),
        ("dyspec", 16, {}),
        ("dyspec", 64, {}),
        ("chain", 4, {}),
        ("sequoia", 16, {"acceptance": [0.3, 0.1, 0.05, 0.03]}),
        ("sglang", 16, {"topk": 4, "steps": 3}),
        ("dyspec-threshold", 16, {}),
        ("specdecpp", 16, {}),
    ],
)
def test_compiled_programs_keep_the_step_exact(default_pair, policy, budget, options):
    """Greedy: `ar`'s tokens, with the host build's tokens per forward (the same trees)."""
    assert default_pair.fast_path == "compiled"
    ar = generate(default_pair, PROMPTS[0], policy="ar", max_new_tokens=32)
    kwargs = dict(policy=policy, budget=budget, max_new_tokens=32)
    device = generate(default_pair, PROMPTS[0], options=options | {"step": "device"}, **kwargs)
    host = generate(default_pair, PROMPTS[0], options=options, **kwargs)
    assert device.token_ids == host.token_ids == ar.token_ids
    assert device.target_forwards == host.target_forwards
    assert not programs.FAILED


@pytest.mark.parametrize("budget", [16, 64])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_compiled_step_reads_once_and_dispatches_at_most_60_ops(default_pair, budget, temperature):
    """The counter at the dispatcher, a compiled program's call one op: one host read a step, and
    at most 60 ops outside the models' forwards at budget 64, greedy or sampled (the eager
    programs: hundreds; T > 0's node-by-node walk, thousands)."""
    options = {"step": "device"}
    counts = step_counts(default_pair, PROMPTS[1], "dyspec", budget, 24, options=options, temperature=temperature)
    assert counts["steps"] > 3 and counts["reads"] == 1
    assert counts["ops"] <= 60, counts


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize(
    "policy, budget, options",
    [
        ("chain", 16, {}),
        ("sequoia", 64, {"acceptance": [0.3, 0.1, 0.05, 0.03]}),
        ("specinfer", 32, {}),
        ("sglang", 64, {}),
        ("eagle2", 64, {}),
        ("specdecpp", 32, {}),
        ("dyspec-threshold", 64, {}),
    ],
)
def test_every_tree_policy_reads_once_a_step_and_dispatches_a_few_ops_a_draft_forward(
    default_pair, policy, budget, options, temperature
):
    """Every draft-model tree policy's step on the device, compiled: one host read a step, greedy or
    sampled, and around its draft forwards (a forward's inputs program, its copies' program, the
    round's program, the forward's output views, a race's uniforms drawn: at most 7 ops each) at
    most 30 ops of the step's own (the root's forward, the target's inputs, verification, the
    read, the commits)."""
    options = options | {"step": "device"}
    counts = step_counts(default_pair, PROMPTS[2], policy, budget, 16, options=options, temperature=temperature)
    assert counts["steps"] > 2 and counts["reads"] == 1, counts
    assert counts["draft_forwards"] > 1 and counts["ops"] <= 30 + 7 * counts["draft_forwards"], counts


@pytest.mark.parametrize(
    "policy, temperature, options",
    [
        (dyspec, 0.0, {"select": "top"}),
        (dyspec, 0.8, {}),  # the race over the draws' uniforms
        (dyspec_threshold, 0.0, {}),
        (dyspec_threshold, 0.8, {"width": 4}),
        (chain, 0.8, {}),  # a sampled link
    ],
)
def test_a_compiled_program_grows_the_eager_ones_tree(policy, temperature, options):
    """Each program compiled against itself eager on a table draft with many exact ties, from the same
    generator: the same tree, its probabilities equal to fp32 rounding (the compiled softmax sums in
    its own order)."""
    for seed in range(3):
        for budget in (5, 16, 33):
            draft = TableDraft(12, seed)
            trees = []
            for compiled in (False, True):
                draft.compiled, g = compiled, torch.Generator().manual_seed(seed)
                trees.append(grown_tree(policy.grow(draft, 3, budget, temperature, g, policy.POLICY.options | options)))
            eager, compiled = trees
            assert (compiled.tokens, compiled.parents, compiled.growth) == (eager.tokens, eager.parents, eager.growth)
            assert compiled.draft_probs == pytest.approx(eager.draft_probs, rel=1e-6, abs=0), (seed, budget)
    assert not programs.FAILED


@pytest.mark.parametrize("design", ["dyspec", "specdecpp"])
def test_the_heads_compiled_programs_grow_the_eager_ones_trees(tmp_path, design):
    """specdecpp's stop and dyspec's rounds with score="head", each node's head prediction inside a
    program, compiled against eager: the same tree, the same predictions to fp32 rounding."""
    options = {"head": random_head(tmp_path, design)}
    cases = [
        (specdecpp, 0.0, {"h": 0.5, "min_k": 1, "max_k": 8}),
        (specdecpp, 0.8, {"h": 0.3, "min_k": 2, "max_k": 8}),
        (dyspec, 0.0, {"score": "head", "select": "top", "batch": 3, "max_depth": 2}),
        (dyspec, 0.8, {"score": "head"}),
    ]
    for seed in range(3):
        draft = HiddenTable(12, seed)
        for policy, temperature, case in cases:
            trees = []
            for compiled in (False, True):
                draft.compiled, g = compiled, torch.Generator().manual_seed(seed)
                t = policy.grow(draft, 3, 9, temperature, g, policy.POLICY.options | options | case)
                trees.append(grown_tree(t))
            eager, compiled = trees
            assert (compiled.tokens, compiled.parents, compiled.growth) == (eager.tokens, eager.parents, eager.growth)
            predicted = [compiled.extra["predicted_acceptance"], eager.extra["predicted_acceptance"]]
            assert any(predicted[0]) and [p is None for p in predicted[0]] == [p is None for p in predicted[1]]
            assert [p for p in predicted[0] if p] == pytest.approx([p for p in predicted[1] if p], rel=1e-6, abs=0)
    assert not programs.FAILED


def test_a_program_counts_as_one_op_and_one_that_does_not_compile_runs_eager(monkeypatch):
    monkeypatch.setattr(programs, "FAILED", set())  # this test's failure is not the other tests' programs'

    @program
    def fused(x: torch.Tensor) -> torch.Tensor:
        return (x * 2 + 1).sin().cumsum(0)

    @program
    def broken(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        torch._dynamo.graph_break()  # what torch.compile cannot make one program of
        return y + 1

    x = torch.arange(5.0)
    with counting() as eager:
        expected = fused(x)
    with counting() as compiled:
        out = fused(x, compiled=True)
    assert torch.allclose(out, expected) and eager.ops >= 4 and compiled.ops == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(broken(x, compiled=True), x * 2 + 1)
    assert any(name.endswith("broken") for name in programs.FAILED)
    assert any("did not compile here; it runs eager" in str(w.message) for w in caught)


def test_a_program_stays_compiled_past_torch_compiles_default_count_of_versions():
    """A process that runs several pairs makes a program in many versions (each rank here is one);
    past torch.compile's default of 8 it would run eager, op by op, without a word. Dynamo's
    settings are per thread: here the test's own, where the steps' programs run on the model's."""

    @program
    def rank_sum(x: torch.Tensor) -> torch.Tensor:
        return (x * 2 + 1).sum()

    for rank in range(1, 11):
        x = torch.ones((2,) * rank)
        with counting() as count:
            got = rank_sum(x, compiled=True)
        assert got == 3 * 2**rank and count.ops == 1, rank
