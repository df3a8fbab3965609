"""`--budget auto`'s cost model: what a step's forwards cost, in ms, read from the pair's measured
profile (dyspec.auto.profile), never the clock, so that a seeded call repeats.

- t(n) is read at each step's context (`profile_at`), between profiles timed at a few contexts.
- Verification runs at a padded size where the profile says more tokens cost less (`padded_size`),
  and every decision prices t(n) as padded (`padded_profile`).
- The marginal cost of one more tree token is the slope of t(n)'s lower convex hull (`hull_ms`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

PAD_MAX = 4  # the most padding tokens a verification forward takes (`padded_size`)


def interpolate_ms(profile: dict[int, float], n: int) -> float:
    """t(n) from measured points: linear between them, and along the last segment beyond."""
    xs = sorted(profile)
    if n <= xs[0]:
        return profile[xs[0]]
    i = min(bisect.bisect_left(xs, n), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return profile[x0] + (profile[x1] - profile[x0]) * (n - x0) / (x1 - x0)


def profile_at(profiles: dict[int, dict[int, float]], context: int) -> dict[int, float]:
    """t(n) behind `context` cached tokens, from profiles timed at a few contexts (`target_profiles`):
    the shortest context's t(n), moved by the difference the longest one measured (interpolated
    over n between its sizes, so the short profile's lumps stay), in proportion to where `context`
    lies between the two, and no further."""
    (c0, short), *longer = sorted(profiles.items())
    if not longer:
        return short
    c1, long = longer[-1]
    w = min(max((context - c0) / (c1 - c0), 0.0), 1.0)
    gap = {n: ms - interpolate_ms(short, n) for n, ms in long.items()}
    return {n: ms + w * interpolate_ms(gap, n) for n, ms in short.items()}


def padded_size(target_ms: dict[int, float], n: int) -> int:
    """The size to run a verification forward of n tree tokens at: the cheapest measured size from
    n to n + PAD_MAX, n itself unless one is cheaper. Forwards of a few rows on a CPU are lumpy
    (t(3) can exceed t(4)), and padding tokens are never read (`KVSession.forward`)."""
    best = n
    for m in range(n + 1, n + PAD_MAX + 1):
        if m in target_ms and target_ms[m] < interpolate_ms(target_ms, best):
            best = m
    return best


def padded_profile(target_ms: dict[int, float]) -> dict[int, float]:
    """t(n) as `--budget auto` pays it: each measured size at its padded size's cost (`padded_size`)."""
    return {n: interpolate_ms(target_ms, padded_size(target_ms, n)) for n in target_ms}


def hull_ms(target_ms: dict[int, float]) -> dict[int, float]:
    """The measured points on t(n)'s lower convex hull, a profile for `interpolate_ms`: a CPU profile
    is lumpy (t(2) can exceed t(4)), and the hull's slope is the fair marginal cost of one more tree
    token."""
    hull: list[tuple[int, float]] = []
    for point in sorted(target_ms.items()):
        while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) * (point[0] - hull[-2][0]) >= (point[1] - hull[-2][1]) * (
            hull[-1][0] - hull[-2][0]
        ):
            hull.pop()
        hull.append(point)
    return dict(hull)


def best_prefix_size(values: list[float], target_ms: dict[int, float], draft_ms: Callable[[int], float]) -> int:
    """The n in 0..len(values) maximising (1 + sum(values[:n])) / (draft_ms(n) + t(n + 1))."""
    best_n, best_rate, gain = 0, 0.0, 1.0
    for n in range(len(values) + 1):
        if n:
            gain += values[n - 1]
        rate = gain / (draft_ms(n) + interpolate_ms(target_ms, n + 1))
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


def least_paying_chain(rate: float, target_ms: dict[int, float], node_ms: float, most: int) -> int:
    """The fewest nodes (up to `most`) of a chain, each accepted at `rate` if its parent was and
    costing `node_ms` of draft time, whose step makes more tokens per ms than one that drafts
    nothing; 0 if none does. Where t(n) is convex that is one node or none; where it is not (fp32
    forwards of a few rows on a CPU: t(2) above t(4)), a chain can pay where one node cannot."""
    gain, value, root_rate = 1.0, 1.0, 1 / interpolate_ms(target_ms, 1)
    for n in range(1, most + 1):
        value *= rate
        gain += value
        if gain / (n * node_ms + interpolate_ms(target_ms, n + 1)) > root_rate:
            return n
    return 0


@dataclass(frozen=True)
class StepCost:
    """t(n) at one step's context: as measured (`measured_ms`, what padding is chosen by) and as
    verification pays it, padded (`target_ms`, what every decision prices)."""

    measured_ms: dict[int, float]
    target_ms: dict[int, float]


@dataclass(frozen=True)
class CostModel:
    """A pair's profile: the target's t(n) at a few contexts, and the draft's ms per forward of n tokens."""

    target_profiles: dict[int, dict[int, float]]
    draft_ms: dict[int, float]

    def at(self, context: int) -> StepCost:
        measured = profile_at(self.target_profiles, context)
        return StepCost(measured, padded_profile(measured))

    def draft_forward_ms(self, tokens: int) -> float:
        return interpolate_ms(self.draft_ms, tokens)
