"""Token Recycling (Luo et al. 2024; Luowaterbi/TokenRecycling, `evaluation/inference_recycling.py`):
no draft model. After every verification the target's own top-k candidates for the token after
each tree node, which a step computes and then mostly throws away, are kept in an adjacency table:
token -> its k most likely successors, as last seen (`learn`). The next tree is grown from the root
through that table, by `shape`: "best-first" grows it by rank (DySpec's rule, with a rank's weight
where DySpec has a draft probability), so it adapts to the budget; "template" fills the paper's
fixed tree of 80 rank paths ("2.2.2", `model/recycling/tree_template_.py`), its first `budget` paths.

The table lives as long as the pair (`ModelPair.memo`), across generations, as the reference keeps
it across requests (the "recycling" of the name); `forget(pair)` clears it. Until it knows the root,
a step drafts nothing. Recycled tokens are chosen, not sampled: their proposals are one-hot and
verified as such ("deterministic"), and what the table holds comes from earlier verifications'
target logits only, so outputs keep the target's distribution (a seeded run at T > 0 repeats
exactly only from the same table). A replay has no target logits to learn from, so it refuses
this policy.
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
SHAPES = ("best-first", "template")
# the paper's tree ("2.2.2"): each node's path of successor ranks from the root, breadth-first
# fmt: off
TEMPLATE = (
    *((r,) for r in range(8)),
    *((0, r) for r in range(8)), (1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (3, 0), (3, 1),
    (4, 0), (5, 0), (6, 0), (7, 0),
    *((0, 0, r) for r in range(8)), (0, 1, 0), (0, 1, 1), (0, 1, 2), (0, 2, 0), (0, 2, 1), (0, 3, 0),
    (0, 4, 0), (0, 5, 0), (0, 6, 0), (0, 7, 0), (1, 0, 0), (1, 0, 1), (1, 1, 0), (2, 0, 0), (3, 0, 0),
    (4, 0, 0), (5, 0, 0),
    *((0, 0, 0, r) for r in range(5)), (0, 0, 1, 0), (0, 0, 1, 1), (0, 0, 2, 0), (0, 0, 3, 0), (0, 0, 4, 0),
    (0, 1, 0, 0), (0, 2, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0), (3, 0, 0, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 0, 2), (0, 0, 0, 1, 0), (0, 0, 0, 2, 0), (0, 0, 1, 0, 0),
    (0, 1, 0, 0, 0), (1, 0, 0, 0, 0),
    (0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 1), (0, 0, 0, 1, 0, 0),
)
# fmt: on


def forget(pair) -> None:
    """Clear the pair's table: the next generation starts from nothing, as a fresh process does."""
    pair.memo.pop("recycling", None)


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
    shape: str = "best-first",
) -> Tree:
    if not 1 <= width <= K:
        raise DyspecError(f"recycling's width must be 1 to {K} successors, got {width}")
    if max_depth < 1:
        raise DyspecError(f"max_depth must be >= 1, got {max_depth}")
    if shape not in SHAPES:
        raise DyspecError(f"recycling's shape must be one of {', '.join(SHAPES)}, got '{shape}'")
    table: dict[int, list[int]] = draft.memo.get("recycling", {})
    tree = Tree.root(root, sampling="deterministic")
    if shape == "template":
        return template_tree(tree, table, budget, width, max_depth)
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


def template_tree(tree: Tree, table: dict[int, list[int]], budget: int, width: int, max_depth: int) -> Tree:
    """The template's paths in its order, each where the table knows its parent's token and the rank
    (and `width` and `max_depth` allow it), up to `budget` nodes."""
    node_of = {(): 0}
    for path in TEMPLATE:
        if tree.size >= budget:
            break
        parent, rank = node_of.get(path[:-1]), path[-1]
        successors = table.get(tree.tokens[parent], ()) if parent is not None else ()
        if rank < min(width, len(successors)) and len(path) <= max_depth:
            node_of[path] = tree.add(parent, successors[rank], RANK_WEIGHTS[rank])
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
