"""`--budget auto`'s rules: size each step's tree by expected committed tokens per ms, every ms
priced by the pair's measured profile. The controller that applies them is dyspec.auto.controller;
docs/concepts/budget-auto.md states each rule with its reason.

- A node's value is its estimated chance of acceptance: the product over its path of rates learnt
  per bin (`node_bins`, `copy_bin`, `bin_rates`).
- Chosen children (T = 0, top-k): any cut closed under ancestors keeps verification exact, so the
  cut keeps the n most valuable nodes, n maximising (1 + sum of values) / (draft ms + t(n + 1))
  (`best_prefix_size`). Sampled children (T > 0): no decision may read a node's own token, so a
  node stays in id order while its value as known before its draw pays its marginal cost
  (`sampled_keep`).
- The next cap is the size worth building, grown by one draft forward's nodes after steps in
  which everything built paid (`plan_next_cap`, `set_next_cap`); where no chain pays, steps draft
  nothing but an occasional probe (`step_cap`).
- Verification runs at a padded size where the profile says more tokens cost less
  (`padded_size`), and t(n) is read at each step's context (`profile_at`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

from dyspec.core.contract import BINS, slot_bin
from dyspec.core.tree import Tree

AUTO_CAP = 64
AUTO_START = 16
PROBE_AFTER = 8  # steps without drafting before a probe; doubled when drafting stops again soon
PROBE_MAX = 128
GROW_MAX = 16  # the most steps that must pay in full before the cap grows again
PAD_MAX = 4  # the most padding tokens a verification forward takes (`padded_size`)


def next_auto_cap(worth: int, room: int) -> int:
    """The size worth building and `room` more, the nodes one more draft forward adds: room to grow
    when everything built paid, at the cost of at most one draft forward. A chain adds one node per
    forward (each a full draft step: a quarter more nodes, the first rule, cost it ~25% of a step).
    No floor above that: where a draft forward costs most of a target forward (the int8 draft on a
    CPU with AMX, 0.75x), one node can be all that pays, and a floor of 4 made a chain pay 4 draft
    forwards a step."""
    return min(AUTO_CAP, worth + max(1, room))


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
    n to n + PAD_MAX, n itself unless one is cheaper. fp32 forwards of a few rows on a CPU are
    lumpy (the default target on a 2-core AMD EPYC: t(3) = 108 ms, t(4) = 80; t(7) = 94, t(8) =
    74), so 3 tree tokens and one of padding, which no token reads (`KVSession.forward`), cost
    less than 3."""
    best = n
    for m in range(n + 1, n + PAD_MAX + 1):
        if m in target_ms and target_ms[m] < interpolate_ms(target_ms, best):
            best = m
    return best


def padded_profile(target_ms: dict[int, float]) -> dict[int, float]:
    """t(n) as `--budget auto` pays it: each measured size at its padded size's cost (`padded_size`)."""
    return {n: interpolate_ms(target_ms, padded_size(target_ms, n)) for n in target_ms}


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


def slot_keys(tree: Tree) -> list[float]:
    """Each drafted node's slot, as known before its token was drawn: the chance that two draws from
    its proposal q agree, sum of q(x)^2 over the tokens its earlier siblings did not take. It is the
    expected draft probability of the token the slot will draw (what T = 0 reads after the fact),
    times the mass the earlier siblings left; high where the draft is sure, low for a late sibling."""
    sums: dict[int, float] = {}  # parent (or node, for its own proposal) -> sum of q^2
    taken: dict[int, float] = {}  # parent -> sum of q^2 over the tokens its children so far took
    seen: dict[int, set[int]] = {}
    out = []
    for s in range(1, len(tree)):
        u, q = tree.parents[s], tree.proposal(s)
        source = s if s in tree.child_q else u
        if source not in sums:
            sums[source] = float(q.square().sum())
        out.append(max(0.0, sums[source] - taken.get(u, 0.0)))
        if tree.tokens[s] not in seen.setdefault(u, set()):
            seen[u].add(tree.tokens[s])
            taken[u] = taken.get(u, 0.0) + float(q[tree.tokens[s]]) ** 2
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


DECAY = 0.8  # weight of earlier steps' tokens per ms: it follows the text within a few steps
TABLE_DECAY = 0.95  # weight of earlier steps' acceptance counts: ~20 steps of evidence
PRIOR = 2.0  # pseudo-nodes per bin, accepted at the bin's prior rate (`bin_rates`)
STOP_EVIDENCE = 8.0  # first children reached (decayed) before they may lower the stop's bound (`plan_next_cap`)
DEPTHS = 4  # depths whose first children learn their own rate (`position_values`), the last and deeper pooled
COPY = 2 * BINS  # the first bin of tokens copied from the context (`lookup`), one per match length (`copy_bin`)
MATCHES = 4  # match lengths with a bin of their own, the last and longer pooled


@dataclass
class AutoState:
    """What `--budget auto` carries from step to step, and from one generation to the next when the
    caller passes the same state again (`stream(..., auto_state=state)`, for one pair, policy,
    temperature and options); all of it comes from past steps."""

    cap: int = AUTO_START  # 0: no tree paid for its draft time, so steps draft nothing (`step_cap`)
    probe_cap: int = 1  # what a step builds while `cap` is 0, when a probe is due
    probe_after: int = PROBE_AFTER
    idle: int = 0  # steps since the draft last built a tree
    drafted: int = 0  # trees built since the last step that drafted nothing
    grow_after: int = 1  # steps in a row in which everything built paid before the cap grows
    paid: int = 0  # steps in a row in which everything built paid
    grew: bool = False  # the cap for the next tree is more than the last tree's size worth building
    # per bin (`node_bins`, `copy_bin`): decayed counts of nodes whose parent verification reached,
    # and of those it accepted
    reached: list[float] = field(default_factory=lambda: [0.0] * (COPY + MATCHES))
    accepted: list[float] = field(default_factory=lambda: [0.0] * (COPY + MATCHES))
    # the same per depth (1 .. DEPTHS, deeper pooled), for nodes of the first group (`group_rates`)
    depth_reached: list[float] = field(default_factory=lambda: [0.0] * DEPTHS)
    depth_accepted: list[float] = field(default_factory=lambda: [0.0] * DEPTHS)
    rate: float | None = None  # decayed tokens per ms of the steps so far, their ms priced by the profile


def step_cap(state: AutoState) -> int:
    """This step's cap: the learnt one or, where that is 0, a probe of `probe_cap` nodes once
    `probe_after` steps have drafted nothing: the draft's acceptance and cost are measured only
    by drafting, and the machine's speed drifts."""
    return state.cap or (state.probe_cap if state.idle >= state.probe_after else 0)


def set_next_cap(state: AutoState, worth: int, room: int, stop: bool, paid: bool = True, least: int = 1) -> None:
    """The next step's cap: the size worth building (at least `least`, the smallest chain that
    might pay: `least_paying_chain`), `room` more once `grow_after` steps in a row paid in full
    (`paid`: everything built paid, so more might), or with `stop` (no chain pays for the draft
    forwards it needs, against a step that runs no draft at all) 0: then no step drafts but a
    probe. Growing is a bet of one draft forward: where the grown tree did not pay in
    full, the next bet waits twice as many steps (up to GROW_MAX); where it did, the next comes at
    once. Room every step made a draft whose second node never paid build two nodes a step
    (DySpec at T = 0.6 with the distilled draft: 1.9 draft forwards a step, 1.00x of `ar` where
    a fixed budget of 1 made 1.05x). A probe costs more than its tree: the draft first reads
    every token it skipped (the prompt too, in a new answer). So where drafting stops again
    within PROBE_AFTER trees, the next probe comes twice as late; after a longer run that paid,
    the first comes soon."""
    state.idle, state.drafted = 0, state.drafted + 1
    if state.grew:
        state.grow_after = 1 if paid else min(GROW_MAX, 2 * state.grow_after)
    state.paid = state.paid + 1 if paid else 0
    state.grew = not stop and state.paid >= state.grow_after
    if state.grew:
        state.paid = 0
    if not stop:
        state.cap = next_auto_cap(worth, room) if state.grew else max(1, least, worth)
        return
    state.probe_after = PROBE_AFTER if state.drafted > PROBE_AFTER else min(PROBE_MAX, 2 * state.probe_after)
    state.cap, state.probe_cap, state.drafted = 0, next_auto_cap(0, room), 0


def node_bins(tree: Tree, sampled: bool) -> list[int]:
    """Each drafted node's bin: of its draft probability when children were chosen, of its slot key
    when they were sampled (nothing here reads a sampled node's own token), BINS bins up for a
    later sibling. A sampled first child is accepted with chance sum min(p, q), whatever q's shape
    (a self-draft's: 0.8-0.99 in every key bin), a later sibling only after a rejection (0.00-0.11
    in the bins that hold 97% of them); in shared bins, where later siblings are most of the low
    keys, unsure first children were priced like them and the cut dropped the main path. Chosen
    children split the same way, so that the first children's pooled rate (`first_rate_bound`)
    is a chain's: pooled with DySpec's wide layers of unlikely siblings at T = 0 it read ~0.3 for
    the int8 draft, whose top token is accepted ~0.9 of the time, and drafting stopped. A cut
    keeps a kept node's bin."""
    bins, parents = [], set()
    for s, key in enumerate(slot_keys(tree) if sampled else tree.draft_probs[1:], start=1):
        bins.append(slot_bin(key, later=tree.parents[s] in parents))
        parents.add(tree.parents[s])
    return bins


def copy_bin(match: int) -> int:
    """The bin of tokens copied from the context after a match of `match` tokens. A longer match
    repeats more: on the default target's greedy answers to 20 MT-Bench prompts the first copied
    token was right 0.13 of the time after a 1-token match, 0.40 after 2, 0.45 after 3 and 0.95
    after 6 or more, and a chain of 16 copies gave 0.2, 1.1, 2.2 and 6.9 accepted tokens."""
    return COPY + min(match, MATCHES) - 1


def bin_rates(state: AutoState, sampled: bool) -> list[float]:
    """Each bin's acceptance rate: its evidence plus PRIOR pseudo-nodes at a prior rate, the bin's
    centre for chosen children (a calibrated draft), and for sampled children the rate measured so
    far over the bin's group (first children, later siblings), itself starting at 1/2. The bin
    centre would keep sampled first children with a flat q (key near 0) at ~0.05, so the cut drops
    them, verification never reaches them, and the bin never learns otherwise. Copied tokens
    (`copy_bin`) start at 1/2. Every rate is <= 1 in floating point too (accepted <= reached,
    prior <= 1), so a node is worth no more than its parent."""
    priors = group_rates(state) if sampled else [(b + 0.5) / BINS for b in range(BINS)] * 2
    priors += [0.5] * MATCHES
    return [(a + PRIOR * m) / (r + PRIOR) for a, r, m in zip(state.accepted, state.reached, priors)]


def group_rates(state: AutoState) -> list[float]:
    """Per bin, the acceptance rate measured so far over its group (first children, later
    siblings), starting at 1/2: what a sampled slot is worth before its key is known."""
    rates = []
    for group in (slice(0, BINS), slice(BINS, 2 * BINS)):
        rates += [(sum(state.accepted[group]) + PRIOR / 2) / (sum(state.reached[group]) + PRIOR)] * BINS
    return rates


def position_values(state: AutoState, tree: Tree, bins: list[int]) -> list[float]:
    """Each drafted node's value by its position alone: the product, over its path, of the rate
    measured over first children at its depth (prior: all first children, `group_rates`) or over
    all later siblings. A feature draft is surer at depth 1 than deeper, where it reads its own
    predicted feature: the distilled draft's second chain node was accepted ~0.2 of the times its
    parent was, against ~0.34 for the first, and one rate for all first children made a second
    node look worth building."""
    rates = group_rates(state)
    by_depth = [(a + PRIOR * rates[0]) / (r + PRIOR) for a, r in zip(state.depth_accepted, state.depth_reached)]
    # first children read the depth rates, appended after the 2 * BINS group rates
    keys = [b if b >= BINS else 2 * BINS + min(tree.depths[s], DEPTHS) - 1 for s, b in enumerate(bins, start=1)]
    return estimates(rates + by_depth, tree, keys)


def first_rate_bound(state: AutoState) -> float:
    """The pooled acceptance rate of first children (`group_rates`) plus one standard error: what
    decides whether drafting stops. A stop is dear (no evidence comes for the next 8 to 128 steps)
    and the decayed table holds ~20 first children, so a draft accepted 28% of the time read
    0.11-0.15 now and then, below the 0.15 it needed to pay, and stopped."""
    p, n = group_rates(state)[0], sum(state.reached[:BINS]) + PRIOR
    return min(1.0, p + math.sqrt(p * (1 - p) / n))


PRIOR_BOUND = first_rate_bound(AutoState())  # the bound before any evidence (0.85), computed once


def estimates(rates: list[float], tree: Tree, bins: list[int]) -> list[float]:
    """Each drafted node's estimated chance of being accepted: the product, over its path, of its
    bin's acceptance rate (`bin_rates`, `group_rates`)."""
    value = [1.0]
    for s, b in enumerate(bins, start=1):
        # a rate <= 1 times the parent's value never exceeds it, so the most valuable nodes form a
        # tree even where rates are 1 ((v * a) / r can round above v)
        value.append(value[tree.parents[s]] * rates[b])
    return value[1:]


def auto_tree(
    state: AutoState,
    tree: Tree,
    sampled: bool,
    target_ms: dict[int, float],
    build_ms: Callable[[int], float],
    spent_ms: float,
    per_forward: int,
    grows_by_values: bool = False,
    sets_cap: bool = True,
    copied: int = 0,
) -> tuple[Tree, list[int], list[int]]:
    """This step's tree cut to size, the old id of each kept node and the kept nodes' bins; with
    `sets_cap`, sets the next step's cap (not for a tree sized by the answer's end: it says nothing
    of the next answer's trees). `build_ms(n)`: draft ms the first n nodes needed; `spent_ms`:
    draft ms this tree took; `per_forward`: nodes the draft added per forward; `grows_by_values`:
    the policy's tree at a smaller cap is about the most valuable part of this one (DySpec, which
    grows by these estimates under auto, `bin_rates`; DySpec's threshold build, whose threshold is
    1 / cap); `copied`: the nodes are tokens copied from the context after a match of that many
    tokens (`lookup`; 0: drafted nodes), valued at the rate learnt for copies after matches of
    its length (`copy_bin`), which is not the draft's."""
    bins = [copy_bin(copied)] * tree.size if copied else node_bins(tree, sampled)
    values = estimates(bin_rates(state, sampled), tree, bins)
    if sampled:
        rate = state.rate if state.rate is not None else 1 / interpolate_ms(target_ms, 1)
        keep = sampled_keep(tree, values, target_ms, rate)
        # a policy that grows by value (`grows_by_values`) would build about the kept tree at a
        # cap of its size, so the cap follows the kept nodes: over all of DySpec's nodes a few deep
        # valuable ones paid for the late siblings between them, and its cap (its width per draft
        # forward) grew to 64 for trees cut to ~7; the threshold build's cap stayed at 64 (a
        # threshold of 1/64: wide trees, two draft forwards a step) for cuts of ~3. A static shape
        # of a smaller size is not the kept part of a bigger one (Sequoia's tree of 8 is a chain),
        # so there the cap follows every node, in id order, valued by position alone
        # (`position_values`): the next step's keys are not this step's, and a chain's cap that
        # followed them fell after one unsure slot and grew back one node a step.
        if grows_by_values:
            order, ranked = keep, [values[s - 1] for s in keep]
        else:
            order, ranked = list(range(1, len(tree))), position_values(state, tree, bins)
    else:
        by_value = sorted(range(1, len(tree)), key=lambda s: -values[s - 1])  # stable: a parent first on ties
        keep = sorted(by_value[: best_prefix_size([values[s - 1] for s in by_value], target_ms, lambda n: spent_ms)])
        order, ranked = list(range(1, len(tree))), position_values(state, tree, bins)
    if sets_cap:
        plan_next_cap(state, order, ranked, target_ms, build_ms, per_forward, built=len(tree) - 1)
    pruned, old_ids = tree.subtree(keep)
    return pruned, old_ids, [bins[i - 1] for i in keep]


def plan_next_cap(
    state: AutoState,
    order: list[int],
    ranked: list[float],
    target_ms: dict[int, float],
    build_ms: Callable[[int], float],
    per_forward: int,
    built: int,
) -> None:
    """Set the next step's cap from the nodes in the order they would be built, `order`, valued
    `ranked`: the size worth building, or 0 (`set_next_cap`). `built`: the nodes the tree had."""
    # building the first n nodes of `order` takes the draft forwards up to the last of them (by id)
    last = [0, *accumulate(order, max)]

    def draft_ms(n: int) -> float:
        return build_ms(last[n]) if n else 0.0

    worth = best_prefix_size(ranked, target_ms, draft_ms)
    # Values read past steps' rates per position, or this step's slot keys (DySpec's kept nodes,
    # sampled), which are not the next step's: one unsure step must not stop the drafting, unless no chain
    # would pay at the rate at which past first children were accepted, pooled, plus one
    # standard error (`first_rate_bound`), either (a diffuse distilled draft's top token at
    # q ~ 0.2 is accepted a third of the time, and one step of it stopped a chain that paid; at
    # T = 0.6 DySpec stopped after the first answer's 7 trees and waited 48 steps, where one node
    # a step beat `ar`). Where that chain pays only from `least` nodes on, `least` is the smallest
    # next cap. Fewer than STOP_EVIDENCE first children do not lower the bound below its value
    # before any evidence: an answer's first token is often unsure, and one rejected node (bound
    # 0.6) stopped a chain that paid at 0.9; where nothing pays even then, drafting stops at once.
    # A policy that built no node (`ar`, Sequoia's tree of the root alone) has no first node to
    # price.
    bound = first_rate_bound(state)
    if sum(state.reached[:BINS]) < STOP_EVIDENCE:
        bound = max(bound, PRIOR_BOUND)
    node_ms = build_ms(built) / built if built else build_ms(1)  # a tree's first forward reads last step's tokens too
    least = least_paying_chain(bound, target_ms, node_ms)
    stop = worth == 0 and (not built or least == 0)
    set_next_cap(state, worth, per_forward, stop, paid=worth >= built, least=least)


def least_paying_chain(rate: float, target_ms: dict[int, float], node_ms: float) -> int:
    """The fewest nodes of a chain, each accepted at `rate` if its parent was and costing `node_ms`
    of draft time, whose step makes more tokens per ms than
    one that drafts nothing; 0 if no chain of up to AUTO_CAP nodes does. Where t(n) is convex that
    is one node or none. Where it is not, a chain can pay where one node cannot: fp32 forwards of a
    few rows on a CPU cost t(2) = 114 ms against t(1) = 71 and t(4) = 103 (a 2-core AMD EPYC), so
    one node a step never paid, and `auto`, which stopped wherever one node did not pay, drafted
    nothing for the default pair where a fixed budget of 4 made 1.2-1.3x of `ar`."""
    gain, value, root_rate = 1.0, 1.0, 1 / interpolate_ms(target_ms, 1)
    for n in range(1, AUTO_CAP + 1):
        value *= rate
        gain += value
        if gain / (n * node_ms + interpolate_ms(target_ms, n + 1)) > root_rate:
            return n
    return 0


def auto_update(state: AutoState, tree: Tree, bins: list[int], accepted: list[int], step_ms: float) -> None:
    """Learn from the verified (cut) tree and its nodes' bins: acceptance counts per bin, and tokens
    per ms, the step's ms priced by the profile (`AutoBudget`), so that a seeded run repeats."""
    # old evidence fades as new evidence of its kind comes: not in steps that verified no node, and
    # the draft's bins not in copy steps nor the copies' in drafting steps (`lookup` copies on ~1
    # step in 10, and its copy rates, decayed every step, stayed near their prior)
    if bins:
        copies = bins[0] >= COPY
        kind = slice(COPY, None) if copies else slice(0, COPY)
        for table in (state.reached, state.accepted):
            table[kind] = [TABLE_DECAY * x for x in table[kind]]
        if not copies:
            for table in (state.depth_reached, state.depth_accepted):
                table[:] = [TABLE_DECAY * x for x in table]
    on_path = {0, *accepted}
    for s, b in enumerate(bins, start=1):
        if tree.parents[s] in on_path:
            state.reached[b] += 1
            state.accepted[b] += s in on_path
            if b < BINS:
                d = min(tree.depths[s], DEPTHS) - 1
                state.depth_reached[d] += 1
                state.depth_accepted[d] += s in on_path
    rate = (len(accepted) + 1) / step_ms
    state.rate = rate if state.rate is None else DECAY * state.rate + (1 - DECAY) * rate
