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
from dyspec.core.tree_tensors import TreeTensors, add_nodes, new_tree, subtree
from dyspec.errors import DyspecError
from dyspec.policies.common import asks_device, child_mode, drawn_slot, on_device_asked


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
    width: int | None = None,
    auto_rates: list[float] | None = None,
    step: str = "host",
) -> Tree:
    """`width`: at most this many nodes of a layer get children, the most valuable (None: every one
    above t). `auto_rates` (set by the engine under `--budget auto`): acceptance rates per slot bin
    (`dyspec.auto.estimate.bin_rates`); with sampled children a slot is worth the chance of reaching its
    parent times its bin's rate, known before the draw (so this stays exact). `step`: "device"
    grows it with `grow`."""
    t = _threshold(budget, threshold, width)
    on_device_asked(step)
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
        frontier = sorted(next_frontier, key=lambda n: -reach[n])[:width]
    return tree


def _threshold(budget: int, threshold: float | None, width: int | None) -> float:
    t = 1 / max(budget, 2) if threshold is None else threshold
    if not 0 < t < 1:
        raise DyspecError(f"threshold must be in (0, 1), got {t}")
    if width is not None and width < 1:
        raise DyspecError(f"width must be at least 1, got {width}")
    return t


def grow(
    draft: DraftSession, root: int, budget: int, temperature: float, generator: torch.Generator, options: dict
) -> TreeTensors:
    """`build`'s tree (the draft's values) as tensor ops with no host read: min(max_depth, budget)
    layers, each one draft forward of a frontier of `width` rows (the budget where None), each adding
    room for the budget's nodes; where the host's tree has ended, the rows are padding. A layer's
    children are every frontier node's candidates whose slot is worth more than t, taken in
    frontier-then-rank order until the budget is spent, as the host's loop takes them. The tree is
    cut to the budget's rows at the end (`subtree`), so that the target forwards no more than the
    host's tree and padding."""
    t_min = _threshold(budget, options["threshold"], options["width"])
    sample, tau, sampling = child_mode(options["select"], temperature, options["draft_temperature"])
    device, max_depth = draft.kv.device, options["max_depth"]
    width, layers = min(options["width"] or budget, budget), min(max_depth, budget)
    budget_ids = torch.arange(budget, device=device)
    t = new_tree(root, 1 + layers * budget, device, sampling, draft.vocab)
    logits = draft.logits(Tree.root(root, sampling, draft.vocab), [0], on_device=True)
    frontier, live = torch.zeros(1, dtype=torch.long, device=device), torch.ones(1, dtype=torch.bool, device=device)
    for layer in range(layers):
        q = to_probs(logits, tau)
        columns, probs = ranked_children(q, budget, sample, generator)
        t.q.append((q, frontier))
        p = probs.double()
        worth = 1 - torch.nn.functional.pad(p.cumsum(1)[:, :-1], (1, 0)) if sample else p
        ok = (t.values[frontier, None] * worth > t_min) & (p > 0) & live[:, None]
        if layer == 0:  # the root's first child comes whatever its value (`build` says why)
            ok[0, 0] = p[0, 0] > 0
        ok = ok.cumprod(1).bool().flatten()  # a node stops at its first slot worth too little
        rank = ok.cumsum(0)  # 1, 2, ... in frontier-then-rank order: the host's order of adding
        room = budget + 1 - t.valid.sum()  # the root is valid
        # each pick's place among the layer's new nodes; the rest to a spare place, dropped
        at = torch.where(ok & (rank <= room), rank - 1, budget)
        picked = [
            torch.zeros(budget + 1, dtype=x.dtype, device=device).scatter_(0, at, x)[:budget]
            for x in (frontier.repeat_interleave(columns.shape[1]), columns.flatten(), p.flatten())
        ]
        tokens = picked[1] if draft.vocab is None else draft.vocab.tokens(picked[1], q.shape[-1])
        start = 1 + layer * budget
        add_nodes(t, start, picked[0], tokens, picked[2], budget_ids < (at < budget).sum())
        nodes = start + budget_ids
        good = t.valid[nodes] & (t.depths[nodes] < max_depth) & (t.values[nodes] > t_min)
        order = torch.where(good, t.values[nodes], -1.0).sort(descending=True, stable=True).indices[:width]
        frontier, live = nodes[order], good[order]
        if layer + 1 < layers:
            logits = draft.tree_logits(t, frontier)
    # the target forwards every row: the valid nodes in id order (at most the budget's), then padding
    keep = (torch.where(t.valid, 0, len(t)) + torch.arange(len(t), device=device)).argsort()
    return subtree(t, keep[1 : budget + 1])


POLICY = Policy(
    "dyspec-threshold",
    build,
    grow=grow,
    on_device=asks_device,
    needs_draft=True,
    auto=AutoNeeds(rates=True, grows_by_value=True),
    summary="DySpec's threshold build: every node keeps children while their path probability is above a threshold",
)
