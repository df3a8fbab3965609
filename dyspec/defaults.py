"""What a user gets without flags: per device, the fastest exact configuration measured there.

The models are chosen by `dyspec.load.load_pair` (precision "auto": int8 Linear layers on a CPU,
bf16 on a GPU; draft "auto": the feature draft shipped for the target). The policy and budget are
here, one row per device type, each the fastest in a bench on that device
(docs/results/cpu-default.md and cpu-intel-default.md have the runs and their numbers): on a CPU a
forward of n tokens costs more with every n, so small trees win, and `lookup` (copies where the
context repeats, else one drafted token) at a small budget measured fastest, on the compiled int8
forward (dyspec.forward.lean_graph), whose fallback is the eager lean forward
(`dyspec.forward.choose.pick_fast_path`). On a GPU the lean forward replayed as CUDA graphs
(dyspec.forward.cuda_graph) measured fastest by far (an architecture it does not cover runs the
Hugging Face forward); t(n) is nearly flat there, but a draft forward and a step's host work each
cost about as much as a small target's forward, so for the default pair the trees lose and `lookup`
at a small budget measured closest to plain decoding, the best of the speculative settings
(docs/results/gpu-check.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Defaults:
    policy: str
    budget: int | str
    bench_budgets: tuple[int | str, ...]  # what `dyspec bench` compares without --budgets
    fast_path: str = "off"  # dyspec.forward.choose.FAST_PATHS; "off" wherever no other has measured faster


BENCH_POLICIES = ("ar", "chain", "dyspec", "lookup")  # what `dyspec bench` compares without --policies

DEFAULTS = {
    "cpu": Defaults("lookup", 4, (1, 2, 4, "auto"), fast_path="compiled"),
    "cuda": Defaults("lookup", 4, (4, 16, 64, "auto"), fast_path="compiled"),
}
UNMEASURED = Defaults("dyspec", 8, (2, 8, 32, "auto"))  # a device no bench has run on yet (mps)


def defaults_for(device: torch.device | str) -> Defaults:
    """The defaults for a device (`torch.device` or its type, e.g. "cpu")."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return DEFAULTS.get(kind, UNMEASURED)
