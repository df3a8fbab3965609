"""`--budget auto`'s rules for the cut and the cap: size each step's tree by expected committed
tokens per ms, its value from the acceptance estimator (dyspec.auto.estimate), its ms from the cost
model (dyspec.auto.cost). The controller that applies them is dyspec.auto.controller;
docs/concepts/budget-auto.md states each rule with its reason.

- Chosen children (T = 0, top-k): any cut closed under ancestors keeps verification exact, so the
  cut keeps the n most valuable nodes, n maximising (1 + sum of values) / (draft ms + t(n + 1))
  (`best_prefix_size`). Sampled children (T > 0): no decision may read a node's own token, so a
  node stays in id order while its value as known before its draw pays its marginal cost
  (`sampled_keep`).
- The next cap is the size worth building, grown by one draft forward's nodes after steps in
  which everything built paid (`plan_next_cap`, `set_next_cap`); where no chain pays, steps draft
  nothing but an occasional probe (`Growth`, `step_cap`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

from dyspec.auto.cost import best_prefix_size, hull_ms, interpolate_ms, least_paying_chain
from dyspec.auto.estimate import (
    PRIOR_BOUND,
    Acceptance,
    bin_rates,
    copy_bin,
    estimates,
    first_rate_bound,
    node_bins,
    position_values,
)
from dyspec.core.contract import BINS
from dyspec.core.tree import Tree

AUTO_CAP = 64
AUTO_START = 16
PROBE_AFTER = 8  # steps without drafting before a probe; doubled when drafting stops again soon
PROBE_MAX = 128
GROW_MAX = 16  # the most steps that must pay in full before the cap grows again
STOP_EVIDENCE = 8.0  # first children reached (decayed) before they may lower the stop's bound (`plan_next_cap`)


@dataclass
class Growth:
    """The cap's state machine, in one of three phases (`phase`):

    - "drafting": each tree is built up to `cap` nodes; the cap grows by one draft forward's nodes
      after `grow_after` steps in a row (`paid`) in which everything built paid;
    - "stopped" (`cap` 0): no chain pays for its draft time, so steps draft nothing; `idle` counts them;
    - "probing": stopped for `probe_after` steps, the next tree is a probe of `probe_cap` nodes."""

    cap: int = AUTO_START
    probe_cap: int = 1
    probe_after: int = PROBE_AFTER
    idle: int = 0  # steps since the draft last built a tree
    drafted: int = 0  # trees built since the last step that drafted nothing
    grow_after: int = 1
    paid: int = 0
    grew: bool = False  # the cap for the next tree is more than the last tree's size worth building

    @property
    def phase(self) -> str:
        if self.cap:
            return "drafting"
        return "probing" if self.idle >= self.probe_after else "stopped"


@dataclass
class AutoState:
    """What `--budget auto` carries from step to step, and from one generation to the next when the
    caller passes the same state again (`stream(..., auto_state=state)`, for one pair, policy,
    temperature and options); all of it comes from past steps."""

    acceptance: Acceptance = field(default_factory=Acceptance)
    growth: Growth = field(default_factory=Growth)


def step_cap(growth: Growth) -> int:
    """This step's cap by phase: the learnt cap, a probe's, or 0 (draft nothing). A stopped draft is
    probed now and then: its acceptance and cost are measured only by drafting, and the machine's
    speed drifts."""
    return {"drafting": growth.cap, "probing": growth.probe_cap, "stopped": 0}[growth.phase]


def next_auto_cap(worth: int, room: int) -> int:
    """The size worth building and `room` more, the nodes one more draft forward adds (a chain's: one
    node), at the cost of at most one draft forward. No floor: where a draft forward costs most of
    a target forward, one node can be all that pays."""
    return min(AUTO_CAP, worth + max(1, room))


def set_next_cap(growth: Growth, worth: int, room: int, stop: bool, paid: bool = True, least: int = 1) -> None:
    """The next step's cap: the size worth building (at least `least`, the smallest chain that
    might pay: `least_paying_chain`), `room` more once `grow_after` steps in a row paid in full
    (`paid`: everything built paid, so more might), or with `stop` (no chain pays for the draft
    forwards it needs) 0: then no step drafts but a probe. Growing is a bet of one draft forward:
    where the grown tree did not pay in full, the next bet waits twice as many steps (up to
    GROW_MAX); where it did, the next comes at once. A probe costs more than its tree (the draft
    first reads every token it skipped), so where drafting stops again within PROBE_AFTER trees
    the next probe comes twice as late (up to PROBE_MAX); after a longer run that paid, soon."""
    growth.idle, growth.drafted = 0, growth.drafted + 1
    if growth.grew:
        growth.grow_after = 1 if paid else min(GROW_MAX, 2 * growth.grow_after)
    growth.paid = growth.paid + 1 if paid else 0
    growth.grew = not stop and growth.paid >= growth.grow_after
    if growth.grew:
        growth.paid = 0
    if not stop:
        growth.cap = next_auto_cap(worth, room) if growth.grew else max(1, least, worth)
        return
    growth.probe_after = PROBE_AFTER if growth.drafted > PROBE_AFTER else min(PROBE_MAX, 2 * growth.probe_after)
    growth.cap, growth.probe_cap, growth.drafted = 0, next_auto_cap(0, room), 0


def sampled_keep(tree: Tree, values: list[float], target_ms: dict[int, float], rate: float) -> list[int]:
    """The nodes to verify when children were sampled. In id order a node is kept when its parent and
    its earlier siblings are, and its value as known before its draw (`estimates`) is worth its
    marginal verification cost at `rate` tokens per ms. Nothing here reads a node's own token, and
    a dropped node takes its later siblings and its subtree with it, so every verifier
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


@dataclass(frozen=True)
class Built:
    """How a step's tree was built, as the cut and the next cap price it."""

    sampled: bool  # children were drawn (T > 0): no decision may read a node's own token
    spent_ms: float  # draft ms the tree took
    build_ms: Callable[[int], float]  # draft ms its first n nodes needed
    per_forward: int  # nodes the draft added per forward
    grows_by_value: bool = False  # the policy's tree at a smaller cap is about the most valuable part of this one
    copied: int = 0  # the nodes are tokens copied from the context after a match of that many (0: drafted)


def auto_tree(
    state: AutoState, tree: Tree, built: Built, target_ms: dict[int, float], sets_cap: bool = True, whole: bool = False
) -> tuple[Tree, list[int], list[int]]:
    """This step's tree cut to size, the old id of each kept node and the kept nodes' bins; with
    `sets_cap`, sets the next step's cap (not for a tree sized by the answer's end: it says nothing
    of the next answer's trees). Copies are valued at the rate learnt for copies after matches of
    their length (`copy_bin`), not the draft's. `whole`: every node kept, for a tree verified on
    the device, whose target forward has the built size whatever a cut would keep."""
    acceptance = state.acceptance
    bins = [copy_bin(built.copied)] * tree.size if built.copied else node_bins(tree, built.sampled)
    values = estimates(bin_rates(acceptance, built.sampled), tree, bins)
    every = list(range(1, len(tree)))
    if whole:
        keep = every
    elif built.sampled:
        rate = acceptance.tokens_per_ms if acceptance.tokens_per_ms is not None else 1 / interpolate_ms(target_ms, 1)
        keep = sampled_keep(tree, values, target_ms, rate)
    else:
        by_value = sorted(every, key=lambda s: -values[s - 1])  # stable: a parent first on ties
        n = best_prefix_size([values[s - 1] for s in by_value], target_ms, lambda n: built.spent_ms)
        keep = sorted(by_value[:n])
    if sets_cap:
        # A policy that grows by value builds about the kept tree at a cap of its size, so its cap
        # follows the kept nodes. A static shape of a smaller size is not the kept part of a bigger
        # one, and the next step's keys are not this step's: there the cap follows every node in id
        # order, valued by position alone.
        if built.sampled and built.grows_by_value:
            order, ranked = keep, [values[s - 1] for s in keep]
        else:
            order, ranked = every, position_values(acceptance, tree, bins)
        plan_next_cap(state, order, ranked, target_ms, built, nodes=len(tree) - 1)
    pruned, old_ids = (tree, [0, *keep]) if whole else tree.subtree(keep)
    return pruned, old_ids, [bins[i - 1] for i in keep]


def plan_next_cap(
    state: AutoState, order: list[int], ranked: list[float], target_ms: dict[int, float], built: Built, nodes: int
) -> None:
    """Set the next step's cap from the nodes in the order they would be built, `order`, valued
    `ranked`: the size worth building, or 0 (`set_next_cap`). `nodes`: the nodes the tree had.

    One unsure step must not stop the drafting: it stops only where no chain would pay at the rate
    at which past first children were accepted, pooled, plus one standard error
    (`first_rate_bound`); where a chain pays only from `least` nodes on, `least` is the smallest
    next cap. Fewer than STOP_EVIDENCE first children do not lower the bound below its value before
    any evidence: an answer's first token is often unsure. A policy that built no node (`ar`, a
    tree of the root alone) has no first node to price."""
    # building the first n nodes of `order` takes the draft forwards up to the last of them (by id)
    last = [0, *accumulate(order, max)]

    def draft_ms(n: int) -> float:
        return built.build_ms(last[n]) if n else 0.0

    worth = best_prefix_size(ranked, target_ms, draft_ms)
    bound = first_rate_bound(state.acceptance)
    if sum(state.acceptance.reached[:BINS]) < STOP_EVIDENCE:
        bound = max(bound, PRIOR_BOUND)
    # per node, over the whole tree: a tree's first forward reads last step's tokens too
    node_ms = built.build_ms(nodes) / nodes if nodes else built.build_ms(1)
    least = least_paying_chain(bound, target_ms, node_ms, AUTO_CAP)
    stop = worth == 0 and (not nodes or least == 0)
    set_next_cap(state.growth, worth, built.per_forward, stop, paid=worth >= nodes, least=least)
