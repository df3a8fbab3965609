"""SuffixDecoding (Oliaro et al. 2024; vLLM's `suffix` method through Snowflake's arctic-inference):
no draft model. Every earlier occurrence of the context's longest repeated suffix (the last n
tokens, n from `max_match` down to `min_match`) is followed to see what came next; those
continuations form a trie whose edge frequencies are the proposals' probabilities, and the tree
keeps the `budget` most frequent paths, at most `max_depth` deep, grown greedily by path frequency
(DySpec's rule, with counts where DySpec has draft probabilities; ties go to the latest
occurrence). Where `lookup` copies the one
latest continuation as a chain, suffix decoding proposes all of them as a tree, weighted by how
often each came.

The context is the generation's prompt and answer so far (the published method also indexes earlier
answers across requests). Copied tokens are chosen, not sampled: their proposals are one-hot and
verified as such ("deterministic"), so outputs keep the target's distribution. Where nothing
repeats, the step drafts nothing (an `ar` step). Under `--budget auto` copies cost no draft time:
the engine asks for up to `free_budget` of them and cuts the tree to what pays at the rate it
learns for copies after matches of their length, as for `lookup`.
"""

from __future__ import annotations

import heapq
from array import array
from collections import defaultdict
from collections.abc import Sequence
from itertools import islice

import torch

from dyspec.core.contract import AutoNeeds, Policy
from dyspec.core.copying import earlier_starts
from dyspec.core.draft import DraftSession
from dyspec.core.tree import Tree
from dyspec.errors import DyspecError

MAX_OCCURRENCES = 64  # the latest occurrences followed: older ones add little and cost a scan each


def continuations(context: Sequence[int], max_match: int, min_match: int, depth: int) -> tuple[list[list[int]], int]:
    """Up to `depth` tokens after each earlier occurrence (the latest MAX_OCCURRENCES) of the context's
    last n tokens, for the largest n in max_match..min_match that occurs earlier, and n; ([], 0)
    where none does."""
    data = array("i", context).tobytes()
    for n in range(min(max_match, len(context) - 1), min_match - 1, -1):
        starts = islice(earlier_starts(data, n), MAX_OCCURRENCES)
        if found := [list(context[start : start + depth]) for start in starts]:
            return found, n
    return [], 0


def build(
    draft: DraftSession,
    root: int,
    budget: int,
    temperature: float,
    generator: torch.Generator,
    *,
    max_match: int = 8,
    min_match: int = 1,
    max_depth: int = 16,
    free_budget: int | None = None,
) -> Tree:
    if not 1 <= min_match <= max_match:
        raise DyspecError(f"suffix needs 1 <= min_match <= max_match, got min_match={min_match}, max_match={max_match}")
    if max_depth < 1:
        raise DyspecError(f"max_depth must be >= 1, got {max_depth}")
    found, match = continuations(draft.context, max_match, min_match, max_depth)
    counts: dict[tuple[int, ...], int] = {}  # path of tokens -> how many continuations start with it
    for tokens in found:
        for d in range(1, len(tokens) + 1):
            counts[tuple(tokens[:d])] = counts.get(tuple(tokens[:d]), 0) + 1
    children: dict[tuple[int, ...], list[tuple[int, int, tuple[int, ...]]]] = defaultdict(list)
    for i, (path, c) in enumerate(counts.items()):  # by frequency, then the order they were found
        children[path[:-1]].append((-c, i, path))
    tree = Tree.root(root, sampling="deterministic")
    node_of: dict[tuple[int, ...], int] = {(): 0}
    # a path is never more frequent than its prefix, so a node always comes after its parent
    heap = children[()]
    heapq.heapify(heap)
    cap = budget if free_budget is None else free_budget
    while heap and tree.size < cap:
        _, _, path = heapq.heappop(heap)
        parent = path[:-1]
        node_of[path] = tree.add(node_of[parent], path[-1], counts[path] / (counts[parent] if parent else len(found)))
        for child in children[path]:
            heapq.heappush(heap, child)
    if tree.size:
        tree.end_expansion()
    tree.copied_after = match if tree.size else 0
    return tree


POLICY = Policy(
    "suffix",
    build,
    needs_draft=False,
    auto=AutoNeeds(free_nodes=True),
    summary="suffix decoding: no draft model; every earlier continuation of the last words, as a tree",
)
