"""Sequoia (Chen et al. 2024): the DP-optimal static tree for a measured acceptance vector, built
layer by layer (one batched draft forward per layer), children drawn without replacement (or the
top-k at T = 0) and verified without replacement."""

import torch

from dyspec.draft import DraftSession
from dyspec.policies.common import child_mode
from dyspec.policies.contract import Policy
from dyspec.sampling import ranked_children, to_probs
from dyspec.sequoia import acceptance_for, optimal_tree
from dyspec.tree import Tree


def prepare(pair, temperature: float, budget: int, options: dict) -> dict:
    """Fill in the pair's measured acceptance vector (measured once, then cached on disk)."""
    if options.get("acceptance") is None and options.get("parents") is None:
        return {**options, "acceptance": acceptance_for(pair, temperature)}
    return options


def build(
    draft: DraftSession,
    root: int,
    budget: int,
    temperature: float,
    generator: torch.Generator,
    *,
    acceptance: list[float] | None = None,
    parents: list[int] | None = None,
    max_depth: int = 8,
    select: str = "auto",
    draft_temperature: float = 0.6,
) -> Tree:
    """`parents` gives the static tree directly (breadth-first parent ids, root -1); otherwise it is
    the optimal tree for `acceptance`, `budget` and `max_depth`."""
    if parents is None:
        parents = optimal_tree(tuple(acceptance), budget, max_depth)[0]
    sample, tau, sampling = child_mode(select, temperature, draft_temperature)
    tree = Tree.root(root, sampling)
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], start=1):
        children.setdefault(p, []).append(i)
    # static node -> tree node, for the nodes of this layer that have children (an optimal tree can
    # have none: with acceptance (0, 0, ...) at budget 1)
    frontier = {0: 0} if children else {}
    while frontier:
        static = list(frontier)
        q = to_probs(draft.logits(tree, [frontier[s] for s in static]), tau)
        tokens, probs = ranked_children(q, max(len(children[s]) for s in static), sample, generator)
        next_frontier = {}
        for i, s in enumerate(static):
            u = frontier[s]
            tree.q[u] = q[i]
            for c, token, prob in zip(children[s], tokens[i].tolist(), probs[i].tolist()):
                if prob <= 0:
                    break
                node = tree.add(u, token, prob)
                if c in children:
                    next_frontier[c] = node
        tree.end_expansion()
        frontier = next_frontier
    return tree


POLICY = Policy("sequoia", build, needs_draft=True, prepare=prepare)
