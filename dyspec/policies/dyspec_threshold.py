"""DySpec's threshold build (App. A.2): layer by layer, one batched draft forward per layer. A node
keeps adding children while the value of its next child slot exceeds t (the paper prints `v < t`;
it must be `v > t`), a slot valued as DySpec's heap values it (`drawn_slot`): the mass left by the
earlier siblings for sampled children, the child's own value for chosen ones; so the tree is the
heap's tree of the same size (App. A.1) under both selections. t defaults to 1 / budget (1/2 at
budget 1: a lone child must be likelier accepted than not); the budget caps the size.
Under `--budget auto` with sampled children a slot is worth what auto has learnt instead, as in
DySpec's heap (`dyspec.build`): the value left, 1 - the mass drawn, priced a late sibling far above
its chance, so the tree built more siblings than the cut kept, never paid in full, and its cap
(and so t) never grew."""

import torch

from dyspec.core.contract import AutoNeeds, Policy, slot_rate
from dyspec.core.draft import DraftSession
from dyspec.core.sampling import ranked_children, to_probs
from dyspec.core.tree import Tree
from dyspec.errors import DyspecError
from dyspec.policies.common import child_mode, drawn_slot


def build(
    draft: DraftSession,
    root: int,
    budget: int,
    temperature: float,
    generator: torch.Generator,
    *,
    threshold: float | None = None,
    max_depth: int = 16,
    select: str = "auto",
    draft_temperature: float = 0.6,
    auto_rates: list[float] | None = None,
) -> Tree:
    """`auto_rates` (set by the engine under `--budget auto`): acceptance rates per slot bin
    (`dyspec.auto.estimate.bin_rates`); with sampled children a slot is worth the chance of reaching its
    parent times its bin's rate, known before the draw (so this stays exact)."""
    t = 1 / max(budget, 2) if threshold is None else threshold
    if not 0 < t < 1:
        raise DyspecError(f"threshold must be in (0, 1), got {t}")
    sample, tau, sampling = child_mode(select, temperature, draft_temperature)
    learnt = auto_rates is not None and sample
    tree = Tree.root(root, sampling, draft.vocab)
    reach: list[float] | dict[int, float] = {0: 1.0} if learnt else tree.values  # node -> chance of reaching it
    frontier = [0]
    while frontier and tree.size < budget:
        q = to_probs(draft.logits(tree, frontier), tau)
        columns, probs = ranked_children(q, budget, sample, generator)
        extra = (q.square().sum(-1, keepdim=True).expand_as(probs),) if learnt else ()
        # one host read for the layer
        tokens, rows, *squares = tree.candidates(columns, probs, q.shape[-1], *extra)
        squares = [row[0] for row in squares[0]] if learnt else None
        next_frontier = []
        for i, u in enumerate(frontier):
            tree.q[u] = q[i]
            ranked = rows[i]
            for k, (token, prob) in enumerate(zip(tokens[i], ranked)):
                # the value of u's next child slot, as DySpec's heap values it
                if learnt:
                    left = reach[u] * slot_rate(auto_rates, squares[i], later=k > 0)
                else:
                    left = tree.values[u] * drawn_slot(ranked, k, sample)
                # the root's first child comes whatever its value: auto asked
                # for at least one node, and a probe that drew none learnt nothing, so drafting
                # stopped for good (cap 2: t = 1/2, rates at their prior 1/2)
                if (left <= t and tree.size) or prob <= 0 or tree.size >= budget:
                    break
                child = tree.add(u, token, prob)
                if learnt:
                    reach[child] = left
                    squares[i] -= prob**2
                if tree.depths[child] < max_depth and reach[child] > t:
                    next_frontier.append(child)
        tree.end_expansion()
        frontier = sorted(next_frontier, key=lambda n: -reach[n])
    return tree


POLICY = Policy(
    "dyspec-threshold",
    build,
    needs_draft=True,
    auto=AutoNeeds(rates=True, grows_by_value=True),
    summary="DySpec's threshold build: every node keeps children while their path probability is above a threshold",
)
