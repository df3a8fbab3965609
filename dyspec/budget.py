"""`--budget auto`: size each step's tree by expected gain against measured verification cost.

The papers fix the budget (or pick it offline, Sequoia); on a CPU, where one target forward of n
tree tokens costs t(n) that grows with n, the right size depends on how confident the draft is this
step. A policy builds up to a cap; the engine keeps the first n nodes (by node id: ancestors and
earlier siblings have smaller ids, so any prefix is a valid tree for every verifier) that maximise
expected committed tokens per millisecond, (1 + sum of node values) / (draft ms + t(n + 1)).
When the children were sampled (T > 0), keeping a node must not depend on the token drawn there:
keeping only the nodes whose drawn token the draft liked biases what verification outputs. So at
T > 0 the engine decides node by node, in id order, from the nodes before it and the node's
value as known before its draw (`slot_values`), and stops at the first node not worth it.
The draft time of this step is spent by then, so it counts in full for every n; for the next step
the cap is twice the n that was worth *building*, counting the draft forwards the first n nodes
needed (between AUTO_MIN and AUTO_CAP): it grows while the draft is confident and cheap, and
shrinks when it is not.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

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


def causal_prefix_size(
    values: list[float], before_draw: list[float], target_ms: dict[int, float], draft_ms: Callable[[int], float]
) -> int:
    """The first n at which stopping beats every longer prefix, judged without looking at node n + 1's
    token: the nodes kept so far count with their `values`, node n + 1 and any after it with node
    n + 1's value as known `before_draw`."""
    cost = [draft_ms(n) + interpolate_ms(target_ms, n + 1) for n in range(len(values) + 1)]
    gain = 1.0
    for n in range(len(values)):
        rate_more = max((gain + (m - n) * before_draw[n]) / cost[m] for m in range(n + 1, len(values) + 1))
        if rate_more <= gain / cost[n]:
            return n
        gain += values[n]
    return len(values)


def kept_size(tree: Tree, sampled: bool, target_ms: dict[int, float], draft_ms: Callable[[int], float]) -> int:
    """How many of the tree's first nodes to verify: the best prefix when no node was sampled (any
    choice keeps greedy or one-hot verification exact), else the causal rule above."""
    values = tree.values[1:]
    if not sampled:
        return best_prefix_size(values, target_ms, draft_ms)
    return causal_prefix_size(values, slot_values(tree), target_ms, draft_ms)
