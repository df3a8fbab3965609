"""What a user gets without flags: per device, the fastest exact configuration measured there.

The models are chosen by `dyspec.load.load_pair` (precision "auto": int8 Linear layers on a CPU,
bf16 on a GPU; draft "auto": the feature draft shipped for the target). The policy and budget are
here, one row per device type, each the fastest in a bench on that device (docs/results/cpu-default.md
has the runs and their numbers): on a CPU a forward of n tokens costs more with every n, so small
trees win, and `lookup` (copies where the context repeats, else one drafted token) at a small
budget measured fastest, on the compiled int8 forward (dyspec.forward.lean_graph), whose fallback
is the eager lean forward (`dyspec.forward.choose.pick_fast_path`). On a GPU t(n) is flat up to
large trees, and the largest tree measured won.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Defaults:
    policy: str
    budget: int | str
    bench_budgets: tuple[int | str, ...]  # what `dyspec bench` compares without --budgets
    fast_path: str = "off"  # dyspec.forward.static; "off" wherever the static path has not measured faster


BENCH_POLICIES = ("ar", "chain", "dyspec", "lookup")  # what `dyspec bench` compares without --policies

DEFAULTS = {
    "cpu": Defaults("lookup", 4, (1, 2, 4, "auto"), fast_path="compiled"),
    "cuda": Defaults("dyspec", 64, (4, 16, 64, "auto")),
}
UNMEASURED = Defaults("dyspec", 8, (2, 8, 32, "auto"))  # a device no bench has run on yet (mps)


def defaults_for(device: torch.device | str) -> Defaults:
    """The defaults for a device (`torch.device` or its type, e.g. "cpu")."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return DEFAULTS.get(kind, UNMEASURED)
