"""What a user gets without flags: per device, the fastest exact configuration measured there.

The models are chosen by `dyspec.load.load_pair` (precision "auto": int8 Linear layers on a CPU,
bf16 on a GPU; draft "auto": the feature draft shipped for the target). The policy, its options
and the budget are here, one row per device type, each the fastest in a bench on that device
(docs/results/cpu-default.md has the runs and their numbers): on a CPU a forward of n tokens
costs more with every n, so small trees win, and `lookup` at a small budget measured fastest
(copies where the context repeats, else a drafted chain that stops once the draft is unsure, so a
second drafted token is verified only where it is likely accepted), on the compiled int8
forward (dyspec.forward.lean_graph), whose fallback is the eager lean forward
(`dyspec.forward.choose.pick_fast_path`). On a GPU the lean forward replayed as CUDA graphs
(dyspec.forward.cuda_graph) measured fastest by far (an architecture it does not cover runs the
Hugging Face forward); t(n) is nearly flat there, but a draft forward and a step's host work each
cost about as much as a small target's forward, so for the default pair the trees lose and `lookup`
at a small budget measured closest to plain decoding, the best of the speculative settings
(docs/results/gpu-check.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch


def policy_spec(policy: str, options: Mapping[str, object]) -> str:
    """A policy with its options as `dyspec bench --policies` spells it: `lookup:confidence=0.5:fallback=4`."""
    return ":".join([policy, *(f"{k}={v}" for k, v in sorted(options.items()))])


def options_text(options: Mapping[str, object]) -> str:
    """A policy's options in words after its name: ` (fallback=4, confidence=0.5)`, or nothing."""
    return f" ({', '.join(f'{k}={v}' for k, v in options.items())})" if options else ""


def setting_text(policy: str, options: Mapping[str, object], budget: int | str) -> str:
    """A policy, its options and its budget in words: `lookup (fallback=4, confidence=0.5) at budget 4`."""
    return f"{policy}{options_text(options)} at budget {budget}"


@dataclass(frozen=True)
class Defaults:
    policy: str
    budget: int | str
    bench_budgets: tuple[int | str, ...]  # what `dyspec bench` compares without --budgets
    fast_path: str = "off"  # dyspec.forward.choose.FAST_PATHS; "off" wherever no other has measured faster
    # options on top of the policy's own defaults: kept here, not in the policy, so that a policy
    # named alone (and every bench record of it) keeps meaning the same thing on every device
    options: Mapping[str, object] = field(default_factory=dict)

    @property
    def spec(self) -> str:
        return policy_spec(self.policy, self.options)

    @property
    def text(self) -> str:
        return setting_text(self.policy, self.options, self.budget)


BENCH_POLICIES = ("ar", "chain", "dyspec", "default")  # what `dyspec bench` compares without --policies
DEFAULT = "default"  # the policy name that stands for the device's default setting in `dyspec bench`

CPU = Defaults("lookup", 4, (1, 2, 4, "auto"), fast_path="compiled", options={"fallback": 4, "confidence": 0.5})
DEFAULTS = {
    "cpu": CPU,
    # a CPU int8 pair whose kernel runs the avx2 path (no VNNI) pays each further row of a forward in
    # arithmetic, so a tree of two measured fastest there (docs/results/cpu-avx2-default.md)
    "cpu:avx2": replace(CPU, budget=2),
    "cuda": Defaults("lookup", 4, (4, 16, 64, "auto"), fast_path="compiled"),
}
UNMEASURED = Defaults("dyspec", 8, (2, 8, 32, "auto"))  # a device no bench has run on yet (mps)


def defaults_for(device: torch.device | str, int8_kernel: str | None = None) -> Defaults:
    """The defaults for a device (`torch.device` or its type, e.g. "cpu") and, for a CPU int8 pair,
    its int8 kernel's path (`ModelPair.int8_kernel`)."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return DEFAULTS.get(f"{kind}:{int8_kernel}") or DEFAULTS.get(kind, UNMEASURED)


def settings(
    device: torch.device | str,
    policy: str | None,
    budget: int | str | None,
    options: Mapping | None,
    int8_kernel: str | None = None,
) -> tuple[str, int | str, dict]:
    """What a generation runs: what the caller gave, the device's defaults for the rest. The
    default options come with the default policy only when no policy is named: a named policy is
    that policy with its own defaults."""
    d = defaults_for(device, int8_kernel)
    given = dict(options or {})
    return (
        policy or d.policy,
        d.budget if budget is None else budget,
        given if policy else {**d.options, **given},
    )
