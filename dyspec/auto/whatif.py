"""Hardware what-if: the speedup a run's own trees would give on other hardware.

Tokens per forward is a property of the model pair and the data; wall-clock speedup is that times
the hardware's price of a tree. So a run's steps, each (tree size n with its root, draft forwards,
tokens committed), priced with a latency model, give its speedup there:

    speedup = (tokens / sum over steps of [t(n) + draft forwards * d(w)]) * t(1)

with t the target's forward latency, d the draft's at w tokens per draft forward (the step's
drafted nodes over its draft forwards), and t(1) what `ar` pays per token. Python overhead is
not priced: this is the model of the forwards alone, and is labelled "modelled from this run's
acceptance" wherever it is shown.

Latency models come from a profile (`dyspec profile --json`, on this machine or another; PROFILES
ships examples) or from a parametric accelerator: t(n) = t(1) up to a width W (verification is
free while the hardware has idle lanes), then growing linearly; the draft a fraction of t(1).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dyspec.auto.profile import pair_profile
from dyspec.errors import DyspecError

PROFILES = {p.stem: p for p in sorted(Path(__file__).with_name("profiles").glob("*.json"))}


@dataclass
class LatencyModel:
    name: str
    target_ms: Callable[[int], float]  # a forward of n tokens
    draft_ms: Callable[[int], float]  # a draft forward of n tokens


def interpolate(points: dict[int, float]) -> Callable[[int], float]:
    """t(n) through measured points: linear between them, flat below the first, and on the line
    through the last two beyond the last (verification grows about linearly once compute-bound)."""
    ns = sorted(points)
    if not ns:
        raise DyspecError("a latency profile needs at least one measured size")

    def t(n: int) -> float:
        if n <= ns[0] or len(ns) == 1:
            return points[ns[0]] if n <= ns[0] else points[ns[-1]]
        i = min(bisect.bisect_left(ns, n), len(ns) - 1)
        a, b = ns[i - 1], ns[i]
        return points[a] + (points[b] - points[a]) * (n - a) / (b - a)

    return t


def from_profile(profile: dict, name: str) -> LatencyModel:
    """A latency model from a profile as `dyspec profile --json` writes it (`target` and `draft`:
    {n: ms}); without a draft row the draft is free."""
    try:
        target = {int(n): float(ms) for n, ms in profile["target"].items()}
        draft = {int(n): float(ms) for n, ms in profile.get("draft", {"1": 0.0}).items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise DyspecError(f"{name}: not a latency profile (expected `target` and `draft`: {{n: ms}})") from None
    return LatencyModel(name, interpolate(target), interpolate(draft))


def load_profile(source: str | Path) -> LatencyModel:
    """A shipped profile by name (PROFILES) or a JSON file written by `dyspec profile --json`."""
    path = PROFILES.get(str(source), Path(source))
    if not path.is_file():
        shipped = ", ".join(PROFILES)
        raise DyspecError(f"profile not found: {source} (a file from `dyspec profile --json`, or {shipped})")
    try:
        profile = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DyspecError(f"{source}: not JSON ({e})") from None
    return from_profile(profile, profile.get("name", path.stem))


def parametric(t1_ms: float, width: int, draft_fraction: float) -> LatencyModel:
    """An accelerator whose forward costs t(1) up to `width` tokens, then grows linearly, with a
    draft forward at `draft_fraction` of t(1) at any size."""
    if t1_ms <= 0 or width < 1 or draft_fraction < 0:
        raise DyspecError("a parametric accelerator needs t(1) > 0, a width of at least 1 and a draft fraction >= 0")
    return LatencyModel(
        f"t(n) flat to {width}, draft {draft_fraction:.0%} of t(1)",
        lambda n: t1_ms * max(1.0, n / width),
        lambda n: draft_fraction * t1_ms,
    )


def step_shapes(steps: Iterable) -> list[tuple[int, int, int]]:
    """(tree size with its root, draft forwards, tokens committed) per `StepVerified`."""
    return [(len(s.tokens), s.draft_forwards, len(s.emitted)) for s in steps]


def step_ms(model: LatencyModel, size: int, draft_forwards: int) -> float:
    """One step's price: the target's forward of the tree, and the draft's forwards, each of the
    step's drafted nodes spread evenly over them."""
    width = math.ceil((size - 1) / draft_forwards) if draft_forwards else 0
    return model.target_ms(size) + draft_forwards * model.draft_ms(max(width, 1))


def modelled_speedup(
    shapes: Sequence[tuple[int, int, int]], model: LatencyModel, other_ms: float = 0.0, ar_other_ms: float = 0.0
) -> float | None:
    """The run's speedup over `ar` (one token a forward at t(1)) under `model`; None for no steps.
    `other_ms` and `ar_other_ms`: what a step costs besides its forwards (building the tree,
    verifying, committing), the run's and `ar`'s, where they were measured (on this machine)."""
    tokens = sum(emitted for _, _, emitted in shapes)
    if not tokens:
        return None
    steps = sum(step_ms(model, n, f) + other_ms for n, f, _ in shapes)
    return tokens * (model.target_ms(1) + ar_other_ms) / steps


THIS_MACHINE, PARAMETRIC = "this machine", "parametric"


def shipped_models() -> dict[str, LatencyModel]:
    """The example profiles that ship (PROFILES), by name."""
    return {name: load_profile(name) for name in PROFILES}


def choose_model(
    choice: str, pair, profiles: dict[str, LatencyModel], width: int = 64, draft_fraction: float = 0.1
) -> LatencyModel:
    """The latency model a view's what-if menu names: THIS_MACHINE (measured once and cached,
    `dyspec.auto.profile.pair_profile`), one of `profiles`, or PARAMETRIC."""
    if choice == THIS_MACHINE:
        return from_profile(pair_profile(pair), THIS_MACHINE)
    if choice == PARAMETRIC:
        return parametric(1.0, width, draft_fraction)  # t(1) cancels out of a speedup
    if choice not in profiles:
        raise DyspecError(f"unknown what-if hardware {choice!r}; choose one of: {', '.join(profiles)}")
    return profiles[choice]


def whatif_line(steps, model: LatencyModel) -> str:
    """The what-if as the views show it, always labelled as a model."""
    speedup = modelled_speedup(step_shapes(steps), model)
    if speedup is None:
        return "no steps to price yet"
    return f"{speedup:.2f}x on {model.name} (modelled from this run's acceptance)"
