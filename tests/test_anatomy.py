"""The step's anatomy (dyspec.eval.anatomy): ops outside the models' forwards and host reads, counted
at the dispatcher."""

from pathlib import Path

import numpy as np
import pytest
import torch

from dyspec.core import kv
from dyspec.eval.anatomy import _on_steps, anatomy, anatomy_table, counting, step_counts

from .conftest import PROMPTS


def site_of(path: str, text: str) -> str:
    """The "file:line" of the line of `path` that holds `text`, as a read's site is named."""
    lines = Path(path).read_text().splitlines()
    return f"{path}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def test_every_kind_of_host_read_is_counted_once_where_it_is_made():
    t = torch.tensor([1.5, 2.5])
    with counting() as count:
        values = [t[0].item(), bool(t[0] > 1), float(t[1]), int(t[1]), t.tolist(), t.numpy()]
    assert count.reads == 6
    assert sum(count.read_sites.values()) == 6 and all(site.startswith("tests") for site in count.read_sites)
    assert values[:4] == [1.5, True, 2.5, 2] and isinstance(values[5], np.ndarray)
    assert torch.Tensor.tolist is not None and t.tolist() == [1.5, 2.5]  # the methods are back as they were


def test_ops_inside_a_model_call_are_left_out():
    x = torch.ones(4)
    with counting() as count:
        y = x + 1
        with kv.MODEL_CALL.get()():
            for _ in range(5):
                y = y * 2
            y.sum().item()
        z = y - 1
    assert count.ops == 2 and count.reads == 0
    assert z.tolist() == [63.0] * 4
    assert kv.MODEL_CALL.get()().__class__.__name__ == "nullcontext"  # reset after counting


def test_ar_reads_the_host_once_a_step(pair):
    ar = step_counts(pair, PROMPTS[0], "ar", 1, max_new_tokens=12)
    assert (
        ar["steps"] == 11
        and ar["reads"] == 1
        and list(ar["read_sites"]) == [site_of("dyspec/decode/step.py", "target_argmax.tolist()")]
    )
    assert 0 < ar["ops"] < 20
    row = {"ops": 3, "reads": 1, "host_ms": 0.5, "tokens": 1, "draft_forwards": 0}
    assert "| `x@1` | 3 | 1 | 0 | 0.50 | 1.00 |" in anatomy_table({"x@1": row})
    del row["draft_forwards"]  # a record from before they were counted
    assert "| `x@1` | 3 | 1 | - | 0.50 | 1.00 |" in anatomy_table({"x@1": row})


@pytest.mark.parametrize(
    "policy, budget",
    [("dyspec", 8), ("dyspec", 64), ("sequoia", 16), ("sglang", 16), ("dyspec-threshold", 16), ("specinfer", 16)],
)
def test_a_tree_policy_reads_its_candidates_once_a_draft_forward(pair, policy, budget):
    """Each draft forward's candidates come to the host in one read (`Tree.candidates`), however
    many rows it drafts: the reads the policy and the tree make are at most the step's draft
    forwards, at any budget."""
    from dyspec.decode.engine import generate

    marks = []
    with counting() as count:
        on_step = lambda e: marks.append((count.read_sites.copy(), e.draft_forwards))  # noqa: E731
        generate(pair, PROMPTS[1], policy=policy, budget=budget, max_new_tokens=16, hooks=[_on_steps(on_step)])
    steps = [(b[0] - a[0], b[1]) for a, b in zip(marks, marks[1:])]
    policy_reads = [
        sum(n for site, n in sites.items() if site.startswith(("dyspec/policies", "dyspec/core/tree")))
        for sites, _ in steps
    ]
    assert len(steps) > 2 and sum(policy_reads) > 0
    assert all(reads <= forwards for reads, (_, forwards) in zip(policy_reads, steps)), steps


def test_the_anatomy_of_sampled_steps(pair):
    """`dyspec profile --steps --temperature`: the steps counted and timed at that temperature, the
    step on the device with its one read, the host's build with a read per draft forward and more."""
    rows = anatomy(
        pair, PROMPTS[0], settings=(("dyspec", 8), ("dyspec:step=device", 8)), max_new_tokens=16, temperature=0.8
    )
    host, device = rows["dyspec@8"], rows["dyspec:step=device@8"]
    assert device["reads"] == 1 and host["reads"] > 1
    assert device["tokens"] >= 1 and host["host_ms"] > 0 and device["host_ms"] > 0
