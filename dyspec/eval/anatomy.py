"""What a speculative step does around the two models' forwards, counted: the aten ops it
dispatches and the times the host reads a tensor's value (`item`, `tolist`, `numpy`, `bool`,
`float`, `int`, a copy to the CPU). On a GPU each op is a kernel launch and each read waits for
every kernel queued before it, so these two counts, not a CPU's timings, say what a step will cost
there. A compiled program of the step (dyspec.core.programs) counts as one op: one call of its
fused kernels. The models' own forwards are left out (`dyspec.core.kv.MODEL_CALL`): their kernels
are the forward's business (dyspec.forward), not the step's.
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from dyspec.core import kv, programs
from dyspec.core.events import StepVerified
from dyspec.errors import DyspecError
from dyspec.forward.thread import forward_thread

TORCH = os.path.dirname(torch.__file__)
HERE = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))  # the checkout or site-packages
READ_METHODS = ("tolist", "numpy")  # reads that dispatch no op; `item` and the casts dispatch _local_scalar_dense
# the step policies `dyspec profile` counts (bench's NAME:OPTION=VALUE specs), with the budgets they run at
ANATOMY_STEPS = (
    ("ar", 1),
    ("lookup", 4),
    ("chain", 4),
    ("chain:step=device", 4),
    ("dyspec", 4),
    ("dyspec", 16),
    ("dyspec", 64),
    ("dyspec:step=device", 4),
    ("dyspec:step=device", 16),
    ("dyspec:step=device", 64),
    ("sequoia", 16),
    ("sequoia:step=device", 16),
    ("sglang", 16),
    ("sglang:step=device", 16),
    ("specinfer", 16),
    ("specinfer:step=device", 16),
    ("dyspec-threshold", 16),
    ("dyspec-threshold:step=device", 16),
    ("specdecpp", 16),
    ("specdecpp:step=device", 16),
)


@dataclass
class Count:
    ops: int = 0  # a compiled program's call counts one (dyspec.core.programs)
    reads: int = 0
    read_sites: collections.Counter = field(default_factory=collections.Counter)  # "file:line" of each read

    def read(self) -> None:
        self.reads += 1
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_code.co_filename.startswith((TORCH, __file__)):
            frame = frame.f_back  # past torch's own frames, to the line that read
        self.read_sites[f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"] += 1


def _short(path: str) -> str:
    return os.path.relpath(path, HERE) if path.startswith(HERE) else path


class _Counting(TorchDispatchMode):
    def __init__(self, count: Count):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.count.ops += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count.read()
        elif func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
            if out.device.type == "cpu" and args[0].device.type != "cpu":
                self.count.read()
        return out


@contextmanager
def counting() -> Iterator[Count]:
    """Count the ops and host reads of what runs inside, on this thread, the models' forwards left out."""
    count = Count()
    originals = {name: getattr(torch.Tensor, name) for name in READ_METHODS}

    def reading(method):
        def read(self, *args, **kwargs):
            count.read()
            return method(self, *args, **kwargs)

        return read

    @contextmanager
    def program_call():
        count.ops += 1
        with _disable_current_modes():  # torch.compile runs nothing compiled under a dispatch mode
            yield

    with _Counting(count):
        token = kv.MODEL_CALL.set(_disable_current_modes)
        program_token = programs.PROGRAM_CALL.set(program_call)
        for name, method in originals.items():
            setattr(torch.Tensor, name, reading(method))
        try:
            yield count
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)
            kv.MODEL_CALL.reset(token)
            programs.PROGRAM_CALL.reset(program_token)


@forward_thread
def step_counts(pair, prompt: str, policy: str, budget: int | str, max_new_tokens: int = 48, **kwargs) -> dict:
    """A generation's ops, host reads and draft forwards per step, their medians over its steps but
    the first (which also pays the prefill's), and the call sites of a median step's reads."""
    from dyspec.decode.engine import generate

    with counting() as count:
        marks = []
        hook = lambda e: marks.append((count.ops, count.reads, count.read_sites.copy(), e.draft_forwards))  # noqa: E731
        generate(
            pair, prompt, policy=policy, budget=budget, max_new_tokens=max_new_tokens, hooks=[_on_steps(hook)], **kwargs
        )
    steps = [(b[0] - a[0], b[1] - a[1], b[2] - a[2], b[3]) for a, b in zip(marks, marks[1:])]
    if not steps:
        return {"ops": None, "reads": None, "read_sites": {}, "steps": 0, "draft_forwards": None}
    median = sorted(steps, key=lambda s: (s[1], s[0]))[len(steps) // 2]
    return {
        "ops": statistics.median(s[0] for s in steps),
        "reads": statistics.median(s[1] for s in steps),
        "read_sites": dict(median[2].most_common()),
        "steps": len(steps),
        "draft_forwards": statistics.median(s[3] for s in steps),
    }


def _on_steps(hook):
    return lambda event: hook(event) if isinstance(event, StepVerified) else None


def anatomy(
    pair, prompt: str, settings=ANATOMY_STEPS, max_new_tokens: int = 48, temperature: float = 0.0
) -> dict[str, dict]:
    """Per "policy@budget": ops and host reads per step (`step_counts`) and the step's host time in
    milliseconds (its time outside the two models' forwards, measured in a run of its own: counting
    slows it), on `prompt` at `temperature`, warm; {"error": why} for a policy the pair cannot run
    as it is (sequoia with no acceptance vector for it)."""
    from dyspec.eval.speedup import mean_step, steps_of, warm_up
    from dyspec.policies import parse_policy_spec

    out = {}
    for spec, budget in settings:
        policy, options = parse_policy_spec(spec)
        try:
            warm_up(pair, policy, budget, {}, options, temperature)
        except DyspecError as e:
            out[f"{spec}@{budget}"] = {"error": str(e)}
            continue
        run = dict(max_new_tokens=max_new_tokens, options=options, temperature=temperature)
        counts = step_counts(pair, prompt, policy, budget, **run)
        m = mean_step(steps_of(pair, prompt, policy, budget, **run))
        out[f"{spec}@{budget}"] = counts | {"host_ms": m["overhead_ms"], "tokens": m["tokens"]}
    return out


def anatomy_table(rows: dict[str, dict]) -> str:
    """The counts as a Markdown table; a step's draft forwards beside its ops, which grow with them
    ("-" in records made before they were counted)."""
    lines = [
        "| policy@budget | ops outside forwards | host reads | draft forwards | host ms | tokens |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| `{name}` | not run: {r['error'].split('; ')[0]} | | | | |")
        else:
            forwards = "-" if r.get("draft_forwards") is None else f"{r['draft_forwards']:g}"
            line = f"| `{name}` | {r['ops']:g} | {r['reads']:g} | {forwards} | {r['host_ms']:.2f} | {r['tokens']:.2f} |"
            lines.append(line)
    return "\n".join(lines)


def stamp_line(stamp: dict) -> str:
    """Where the counts were taken (`dyspec.eval.bench.profile_stamp`), in one line under the table."""
    versions = ", ".join(f"{k} {v}" for k, v in stamp["versions"].items())
    return f"{stamp['pair']} on {stamp['host']}; {versions}; `{stamp['command']}`, {stamp['date']}"
