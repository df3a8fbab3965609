"""Token Recycling (Luo et al. 2024): no draft model. After every verification the target's own top-k
candidates for the token after each tree node, which a step computes and then mostly throws away,
are kept in an adjacency table: token -> its k most likely successors, as last seen (`learn`).
The next tree is grown from the root through that table; the paper expands a fixed template of
ranks, here the tree grows best-first by rank (DySpec's rule, with a rank's weight where DySpec has
a draft probability), so it adapts to the budget.

The table is the generation's own (the paper keeps it across requests); it starts empty, so the
first step drafts nothing. Recycled tokens are chosen, not sampled: their proposals are one-hot
and verified as such ("deterministic"), and what the table holds comes from earlier steps' target
logits only, so outputs keep the target's distribution. A replay has no target logits to learn
from, so it refuses this policy.
"""

from __future__ import annotations

import heapq
from itertools import count

import torch

from dyspec.core.contract import Policy
from dyspec.core.draft import DraftSession
from dyspec.core.tree import Tree
from dyspec.errors import DyspecError

K = 8  # successors kept per token, as in the paper
# the weight of a successor of rank r: roughly how often the target's r-th choice is the next token,
# which orders the best-first growth (and is the node's draft probability for `--budget auto`'s bins)
RANK_WEIGHTS = (0.6, 0.15, 0.07, 0.04, 0.03, 0.02, 0.02, 0.01)


def learn(draft: DraftSession, tree: Tree, logits: torch.Tensor) -> None:
    """Keep the target's top K successors of every tree node's token (its logits at the node)."""
    table = draft.memo.setdefault("recycling", {})
    for token, successors in zip(tree.tokens, logits.topk(min(K, logits.shape[-1]), dim=-1).indices.tolist()):
        table[token] = successors


def build(
    draft: DraftSession,
    root: int,
    budget: int,
    temperature: float,
    generator: torch.Generator,
    *,
    width: int = K,
    max_depth: int = 8,
) -> Tree:
    if not 1 <= width <= K:
        raise DyspecError(f"recycling's width must be 1 to {K} successors, got {width}")
    if max_depth < 1:
        raise DyspecError(f"max_depth must be >= 1, got {max_depth}")
    table: dict[int, list[int]] = draft.memo.get("recycling", {})
    tree = Tree.root(root, sampling="deterministic")
    value, order = [1.0], count()
    heap: list[tuple[float, int, int, int]] = []  # (-value, order, parent, rank)

    def push(node: int) -> None:
        if tree.tokens[node] in table and tree.depths[node] < max_depth:
            for rank in range(min(width, len(table[tree.tokens[node]]))):
                heapq.heappush(heap, (-value[node] * RANK_WEIGHTS[rank], next(order), node, rank))

    push(0)
    while heap and tree.size < budget:
        v, _, parent, rank = heapq.heappop(heap)
        tree.add(parent, table[tree.tokens[parent]][rank], RANK_WEIGHTS[rank])
        value.append(-v)
        push(len(tree) - 1)
    if tree.size:
        tree.end_expansion()
    return tree


POLICY = Policy(
    "recycling",
    build,
    needs_draft=False,
    learn=learn,
    summary="token recycling: no draft model; the target's own earlier top candidates, as a tree",
)
