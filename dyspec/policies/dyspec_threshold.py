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
from dyspec.core.programs import program
from dyspec.core.sampling import race_uniforms, ranked_children, to_probs, top_children
from dyspec.core.tree import Tree
from dyspec.core.tree_tensors import TreeTensors, index_on, new_tree, node_tensors, place_nodes, subtree
from dyspec.core.vocab import token_ids
from dyspec.errors import DyspecError
from dyspec.policies.common import (
    asks_device,
    child_mode,
    drawn_slot,
    drawn_slots,
    learnt_scores,
    learnt_worth,
    on_device_asked,
)


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
    """`build`'s tree (the draft's values, or under `--budget auto` with drawn children the rates auto
    learnt, `auto_rates` in `options`) as tensor ops with no host read: min(max_depth, budget)
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
    t = new_tree(root, 1 + layers * budget, device, sampling, draft.vocab, compiled=draft.compiled)
    logits = draft.logits(Tree.root(root, sampling, draft.vocab), [0], on_device=True)
    frontier, live = index_on([0], device), None  # the root, live
    shape, vocab = (budget, width, max_depth, t_min), draft.vocab_columns(device)
    learnt = learnt_scores(options.get("auto_rates"), len(t), device) if sample else None
    for layer in range(layers):
        uniforms = race_uniforms(logits.shape, generator, device) if sample else None
        start = 1 + layer * budget
        args = (logits, uniforms, tau, frontier, live, node_tensors(t), start, layer == 0, shape, learnt, *vocab)
        q, next_frontier, live = threshold_layer(*args, compiled=draft.compiled)
        t.q.append((q, frontier))
        t.growth.append(start + budget)
        frontier = next_frontier
        if layer + 1 < layers:
            logits = draft.tree_logits(t, frontier)
    return subtree(t, kept_nodes(t.valid, budget, compiled=draft.compiled), compiled=draft.compiled)


@program
def threshold_layer(
    logits: torch.Tensor,
    uniforms: torch.Tensor | None,
    tau: float,
    frontier: torch.Tensor,
    live: torch.Tensor | None,
    nodes: tuple[torch.Tensor, ...],
    start: int,
    first: bool,
    shape: tuple[int, int, int, float],
    learnt: tuple[torch.Tensor, torch.Tensor] | None,
    ids: torch.Tensor | None,
    size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer of `grow`, one program: the draft's q after the `frontier` (returned), its children
    worth more than t placed as nodes start.. start + budget - 1 (padding where fewer), and the next
    frontier with which of its rows are live (returned; `live` None: all). A slot is worth the
    chance of reaching its node (its value) times `drawn_slot`'s, or with `learnt` (auto's rates
    and each node's reach, which a child takes from its slot) `learnt_worth`."""
    budget, width, max_depth, t_min = shape
    _, _, depths, _, values, valid, _ = nodes
    q = to_probs(logits, tau)
    columns, probs = top_children(q, budget, uniforms)
    p = probs.double()
    if learnt is not None:
        worth, reach = learnt_worth(q, p, learnt[0]), learnt[1]
    else:
        worth, reach = drawn_slots(p, uniforms is not None), values
    left = reach[frontier, None] * worth
    ok = (left > t_min) & (p > 0)
    if live is not None:
        ok = ok & live[:, None]
    if first:  # the root's first child comes whatever its value (`build` says why)
        ok[0, 0] = p[0, 0] > 0
    ok = ok.cumprod(1).bool().flatten()  # a node stops at its first slot worth too little
    rank = ok.cumsum(0)  # 1, 2, ... in frontier-then-rank order: the host's order of adding
    room = budget + 1 - valid.sum()  # the root is valid
    # each pick's place among the layer's new nodes; the rest to a spare place, dropped
    at = torch.where(ok & (rank <= room), rank - 1, budget)
    sources = [frontier.repeat_interleave(columns.shape[1]), columns.flatten(), p.flatten()]
    sources += [] if learnt is None else [left.flatten()]  # a learnt pick's reach is its slot's value
    picked = [torch.zeros(budget + 1, dtype=x.dtype, device=q.device).scatter_(0, at, x)[:budget] for x in sources]
    tokens = token_ids(picked[1], q.shape[-1], ids, size)
    budget_ids = torch.arange(budget, device=q.device)
    place_nodes(nodes, start, picked[0], tokens, picked[2], budget_ids < (at < budget).sum())
    new = start + budget_ids
    if learnt is not None:
        reach[new] = picked[3]
    good = valid[new] & (depths[new] < max_depth) & (reach[new] > t_min)
    order = torch.where(good, reach[new], -1.0).sort(descending=True, stable=True).indices[:width]
    return q, new[order], good[order]


@program
def kept_nodes(valid: torch.Tensor, budget: int) -> torch.Tensor:
    """The rows the target forwards: the valid nodes in id order (at most the budget's), then padding."""
    ids = torch.arange(len(valid), device=valid.device)
    return (torch.where(valid, 0, len(valid)) + ids).argsort()[1 : budget + 1]


POLICY = Policy(
    "dyspec-threshold",
    build,
    grow=grow,
    on_device=asks_device,
    needs_draft=True,
    auto=AutoNeeds(rates=True, grows_by_value=True),
    summary="DySpec's threshold build: every node keeps children while their path probability is above a threshold",
)
