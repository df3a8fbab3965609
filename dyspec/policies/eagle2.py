"""EAGLE-2-style dynamic tree (Li et al. 2024), as a baseline: expand the `topk` best frontier nodes
by cumulative draft probability, give each its top-k children, keep the global top-k as the next
frontier; after `depth` rounds keep the `budget` best nodes overall. Children are chosen, not
sampled, so at T > 0 they are verified as one-hot proposals, which stays exact."""

import torch

from dyspec.core.contract import Policy
from dyspec.core.draft import DraftSession
from dyspec.core.tree import Tree
from dyspec.policies.common import rerank, top_children


def build(
    draft: DraftSession,
    root: int,
    budget: int,
    temperature: float,
    generator: torch.Generator,
    *,
    topk: int = 8,
    depth: int = 6,
) -> Tree:
    tree = Tree.root(root, "deterministic", draft.vocab)
    frontier = [0]
    for _ in range(depth):
        candidates = sorted(top_children(tree, draft, frontier, topk), key=lambda c: -c[0])
        frontier = [tree.add(u, y, p) for _, u, y, p in candidates[:topk]]
        tree.end_expansion()
    return rerank(tree, draft, budget)


POLICY = Policy(
    "eagle2",
    build,
    needs_draft=True,
    summary="EAGLE-2: expands the likeliest paths for a few rounds, then keeps the budget's best nodes",
)
