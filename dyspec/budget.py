"""`--budget auto`: size each step's tree by expected gain against measured verification cost.

The papers fix the budget (or pick it offline, Sequoia); on a CPU, where one target forward of n
tree tokens costs t(n) that grows with n, the right size depends on how confident the draft is this
step. A policy builds up to a cap, then the engine cuts the tree:
- children chosen, not sampled (T = 0, top-k, EAGLE-2): any cut keeps verification exact, so it
  keeps the first n nodes (by id: ancestors and earlier siblings come first) that maximise expected
  committed tokens per ms, (1 + sum of node values) / (draft ms + t(n + 1));
- children sampled (T > 0): keeping a drafted token only when the draft liked it biases the output,
  so no decision may read a node's own token. In id order, a node stays when its parent and earlier
  siblings did and its slot value (known before its draw) pays for its marginal cost, the slope of
  t(n)'s convex hull times the recent tokens per ms.
Node values are calibrated by the decayed ratio of tokens accepted to value predicted over the
past steps. The draft time of this step is spent by the cut, so it counts in full for every n; the
next step's cap is twice the n worth *building*, counting the draft forwards the first n nodes
needed (between AUTO_MIN and AUTO_CAP): it grows while the draft is confident and cheap.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from dyspec.tree import Tree

AUTO_CAP = 64
AUTO_MIN = 4
AUTO_START = 16


def next_auto_cap(kept: int) -> int:
    return min(AUTO_CAP, max(AUTO_MIN, 2 * kept))


def interpolate_ms(profile: dict[int, float], n: int) -> float:
    """t(n) from measured points: linear between them, and along the last segment beyond."""
    xs = sorted(profile)
    if n <= xs[0]:
        return profile[xs[0]]
    i = min(bisect.bisect_left(xs, n), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return profile[x0] + (profile[x1] - profile[x0]) * (n - x0) / (x1 - x0)


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


def slot_values(tree: Tree) -> list[float]:
    """Each drafted node's value as known before its token was drawn: DySpec's slot value, the
    parent's value times the draft mass its earlier siblings (distinct tokens) left, which is the
    chance that verification gets to try this child if the target were the draft."""
    earlier: dict[int, dict[int, float]] = {}  # parent -> token -> draft probability, of children so far
    out = []
    for s in range(1, len(tree)):
        siblings = earlier.setdefault(tree.parents[s], {})
        out.append(tree.values[tree.parents[s]] * max(0.0, 1 - sum(siblings.values())))
        siblings.setdefault(tree.tokens[s], tree.draft_probs[s])
    return out


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


def sampled_keep(tree: Tree, values: list[float], target_ms: dict[int, float], rate: float) -> list[int]:
    """The nodes to verify when children were sampled. In id order a node is kept when its parent and
    its earlier siblings are, and its value as known before its draw (`slot_values`, calibrated) is
    worth its marginal verification cost at `rate` tokens per ms. Nothing here reads a node's own
    token, and a dropped node takes its later siblings and its subtree with it, so every verifier
    stays exact."""
    hull = hull_ms(target_ms)
    closed: set[int] = set()  # parents whose next children are dropped (an earlier sibling was)
    kept = {0}
    for s in range(1, len(tree)):
        u, n = tree.parents[s], len(kept)  # n: tree tokens in the forward so far, the root included
        marginal_ms = interpolate_ms(hull, n + 1) - interpolate_ms(hull, n)
        if u in kept and u not in closed and values[s - 1] >= rate * marginal_ms:
            kept.add(s)
        else:
            closed.add(u)
    return sorted(kept - {0})


def estimates(tree: Tree, sampled: bool) -> list[float]:
    """What the budget rules count as each drafted node's expected gain: its value (the product of
    draft probabilities on its path) when children were chosen, its slot value when they were sampled."""
    return slot_values(tree) if sampled else tree.values[1:]


DECAY = 0.8  # weight of earlier steps' evidence: the estimates follow the text within a few steps


@dataclass
class AutoState:
    """What `--budget auto` carries from step to step; all of it comes from past steps."""

    cap: int = AUTO_START
    predicted: float = 1.0  # decayed sums of the kept nodes' estimates ...
    accepted: float = 1.0  # ... and of the tokens verification accepted: their ratio calibrates
    rate: float | None = None  # decayed tokens per ms of the steps so far


def auto_tree(
    state: AutoState,
    tree: Tree,
    sampled: bool,
    target_ms: dict[int, float],
    build_ms: Callable[[int], float],
    spent_ms: float,
) -> tuple[Tree, list[int], float]:
    """This step's tree cut to size, the old id of each kept node, and the kept nodes' estimated gain;
    sets the cap of the next step. `build_ms(n)`: draft ms the first n nodes needed."""
    raw = estimates(tree, sampled)
    values = [v * state.accepted / state.predicted for v in raw]
    if sampled:
        rate = state.rate if state.rate is not None else 1 / interpolate_ms(target_ms, 1)
        keep = sampled_keep(tree, values, target_ms, rate)
    else:
        keep = list(range(1, 1 + best_prefix_size(values, target_ms, lambda n: spent_ms)))
    state.cap = next_auto_cap(best_prefix_size(values, target_ms, build_ms))
    pruned, old_ids = tree.subtree(keep)
    return pruned, old_ids, sum(raw[i - 1] for i in keep)


def auto_update(state: AutoState, predicted: float, accepted: int, emitted: int, step_ms: float) -> None:
    state.predicted = DECAY * state.predicted + predicted
    state.accepted = DECAY * state.accepted + accepted
    rate = emitted / step_ms
    state.rate = rate if state.rate is None else DECAY * state.rate + (1 - DECAY) * rate
