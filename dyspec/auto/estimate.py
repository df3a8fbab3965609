"""`--budget auto`'s acceptance estimator: a node's value is its estimated chance of acceptance,
the product over its path of rates learnt online per bin (docs/concepts/budget-auto.md).

- Bins (`node_bins`): of the draft's probability when children are chosen, of the slot's key,
  known before the token is drawn, when they are sampled; first children and later siblings apart.
  Tokens copied from the context have bins of their own, per match length (`copy_bin`).
- Each bin starts with PRIOR pseudo-nodes at a prior rate (`bin_rates`) and its counts fade by
  TABLE_DECAY a step of their kind (`learn`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dyspec.core.contract import BINS, slot_bin
from dyspec.core.tree import Tree

DECAY = 0.8  # weight of earlier steps' tokens per ms: it follows the text within a few steps
TABLE_DECAY = 0.95  # weight of earlier steps' acceptance counts: ~20 steps of evidence
PRIOR = 2.0  # pseudo-nodes per bin, accepted at the bin's prior rate (`bin_rates`)
DEPTHS = 4  # depths whose first children learn their own rate (`position_values`), the last and deeper pooled
COPY = 2 * BINS  # the first bin of tokens copied from the context (`lookup`), one per match length (`copy_bin`)
MATCHES = 4  # match lengths with a bin of their own, the last and longer pooled


@dataclass
class Acceptance:
    """What past steps measured: per bin (`node_bins`, `copy_bin`), decayed counts of nodes whose
    parent verification reached and of those it accepted; the same per depth (1 .. DEPTHS, deeper
    pooled) for first children; and the decayed tokens per ms of the steps, priced by the profile."""

    reached: list[float] = field(default_factory=lambda: [0.0] * (COPY + MATCHES))
    accepted: list[float] = field(default_factory=lambda: [0.0] * (COPY + MATCHES))
    depth_reached: list[float] = field(default_factory=lambda: [0.0] * DEPTHS)
    depth_accepted: list[float] = field(default_factory=lambda: [0.0] * DEPTHS)
    tokens_per_ms: float | None = None


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
        u = tree.parents[s]
        source = s if s in tree.child_q else u
        if source not in sums:
            sums[source] = tree.agreement[s] if s in tree.agreement else float(tree.proposal(s).square().sum())
        out.append(max(0.0, sums[source] - taken.get(u, 0.0)))
        if tree.tokens[s] not in seen.setdefault(u, set()):
            seen[u].add(tree.tokens[s])
            taken[u] = taken.get(u, 0.0) + tree.draft_probs[s] ** 2  # q(token), as drawn
    return out


def node_bins(tree: Tree, sampled: bool) -> list[int]:
    """Each drafted node's bin: of its draft probability when children were chosen, of its slot key
    when they were sampled (nothing here reads a sampled node's own token), BINS bins up for a
    later sibling. A later sibling is accepted only after a rejection, so pooled with first children
    it would price the main path down; and the first children's pooled rate (`first_rate_bound`)
    must be a chain's. A cut keeps a kept node's bin."""
    bins, parents = [], set()
    for s, key in enumerate(slot_keys(tree) if sampled else tree.draft_probs[1:], start=1):
        bins.append(slot_bin(key, later=tree.parents[s] in parents))
        parents.add(tree.parents[s])
    return bins


def copy_bin(match: int) -> int:
    """The bin of tokens copied from the context after a match of `match` tokens: a longer match
    repeats more."""
    return COPY + min(match, MATCHES) - 1


def bin_rates(acceptance: Acceptance, sampled: bool) -> list[float]:
    """Each bin's acceptance rate: its evidence plus PRIOR pseudo-nodes at a prior rate, the bin's
    centre for chosen children (a calibrated draft), and for sampled children the rate measured so
    far over the bin's group (first children, later siblings), itself starting at 1/2: at the bin's
    centre a flat q's first children would be cut, never reached, and never learnt otherwise.
    Copied tokens (`copy_bin`) start at 1/2. Every rate is <= 1 in floating point too (accepted <=
    reached, prior <= 1), so a node is worth no more than its parent."""
    priors = group_rates(acceptance) if sampled else [(b + 0.5) / BINS for b in range(BINS)] * 2
    priors += [0.5] * MATCHES
    return [(a + PRIOR * m) / (r + PRIOR) for a, r, m in zip(acceptance.accepted, acceptance.reached, priors)]


def group_rates(acceptance: Acceptance) -> list[float]:
    """Per bin, the acceptance rate measured so far over its group (first children, later
    siblings), starting at 1/2: what a sampled slot is worth before its key is known."""
    rates = []
    for group in (slice(0, BINS), slice(BINS, 2 * BINS)):
        rates += [(sum(acceptance.accepted[group]) + PRIOR / 2) / (sum(acceptance.reached[group]) + PRIOR)] * BINS
    return rates


def position_values(acceptance: Acceptance, tree: Tree, bins: list[int]) -> list[float]:
    """Each drafted node's value by its position alone: the product, over its path, of the rate
    measured over first children at its depth (prior: all first children, `group_rates`) or over
    all later siblings. A feature draft is surer at depth 1 than deeper, where it reads its own
    predicted feature."""
    rates = group_rates(acceptance)
    by_depth = [
        (a + PRIOR * rates[0]) / (r + PRIOR) for a, r in zip(acceptance.depth_accepted, acceptance.depth_reached)
    ]
    # first children read the depth rates, appended after the 2 * BINS group rates
    keys = [b if b >= BINS else 2 * BINS + min(tree.depths[s], DEPTHS) - 1 for s, b in enumerate(bins, start=1)]
    return estimates(rates + by_depth, tree, keys)


def first_rate_bound(acceptance: Acceptance) -> float:
    """The pooled acceptance rate of first children (`group_rates`) plus one standard error: what
    decides whether drafting stops. A stop is dear (no evidence comes while the draft is idle), and
    the decayed table holds ~20 first children, too few to stop on the rate alone."""
    p, n = group_rates(acceptance)[0], sum(acceptance.reached[:BINS]) + PRIOR
    return min(1.0, p + math.sqrt(p * (1 - p) / n))


PRIOR_BOUND = first_rate_bound(Acceptance())  # the bound before any evidence (0.85), computed once


def estimates(rates: list[float], tree: Tree, bins: list[int]) -> list[float]:
    """Each drafted node's estimated chance of being accepted: the product, over its path, of its
    bin's acceptance rate (`bin_rates`, `group_rates`)."""
    value = [1.0]
    for s, b in enumerate(bins, start=1):
        # a rate <= 1 times the parent's value never exceeds it, so the most valuable nodes form a
        # tree even where rates are 1 ((v * a) / r can round above v)
        value.append(value[tree.parents[s]] * rates[b])
    return value[1:]


def learn(acceptance: Acceptance, tree: Tree, bins: list[int], accepted: list[int], step_ms: float) -> None:
    """Learn from the verified (cut) tree and its nodes' bins: acceptance counts per bin, and tokens
    per ms, the step's ms priced by the profile, so that a seeded run repeats. Old evidence fades
    only as new evidence of its kind comes: not in steps that verified no node, and the draft's
    bins not in copy steps nor the copies' in drafting steps (copies come on few steps, and decayed
    every step their rates would stay near their prior)."""
    if bins:
        copies = bins[0] >= COPY
        kind = slice(COPY, None) if copies else slice(0, COPY)
        for table in (acceptance.reached, acceptance.accepted):
            table[kind] = [TABLE_DECAY * x for x in table[kind]]
        if not copies:
            for table in (acceptance.depth_reached, acceptance.depth_accepted):
                table[:] = [TABLE_DECAY * x for x in table]
    on_path = {0, *accepted}
    for s, b in enumerate(bins, start=1):
        if tree.parents[s] in on_path:
            acceptance.reached[b] += 1
            acceptance.accepted[b] += s in on_path
            if b < BINS:
                d = min(tree.depths[s], DEPTHS) - 1
                acceptance.depth_reached[d] += 1
                acceptance.depth_accepted[d] += s in on_path
    rate, before = (len(accepted) + 1) / step_ms, acceptance.tokens_per_ms
    acceptance.tokens_per_ms = rate if before is None else DECAY * before + (1 - DECAY) * rate
