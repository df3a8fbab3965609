"""SuffixDecoding (Oliaro et al. 2024), as ArcticInference speculates (`SuffixTree::speculate` in
csrc/suffix_decoding/suffix_tree.cc; vLLM's `suffix` method): no draft model. For every match
length n (`min_match` to `max_match`) at which the context's last n tokens occurred before, the
continuations of those occurrences form a trie whose counts give each path's probability (its
count over the match's, the occurrence being matched included); the draft grows from it greedily
by that probability, keeping paths of probability >= `min_token_prob`, at most
n * `max_spec_factor` + `max_spec_offset` nodes (and the budget), `max_depth` deep; its score is its
expected accepted tokens, the sum of its nodes' probabilities. The best-scoring match length wins
(ties to the longer). Where `lookup` copies the one latest continuation as a chain, suffix decoding
proposes all of them as a tree, weighted by how often each came.

The search runs over two sources, as the reference's request tree and global tree: the
generation's own prompt and answer so far, and the answers of the pair's earlier generations
(`ModelPair.memo`; `forget(pair)` clears them). Each follows the latest MAX_OCCURRENCES
occurrences of a match (the reference counts them all). Copied tokens are chosen, not sampled:
their proposals are one-hot and verified as such ("deterministic"), so outputs keep the target's
distribution. Where nothing repeats, the step drafts nothing (an `ar` step). Under `--budget auto`
copies cost no draft time: the engine asks for up to `free_budget` of them and cuts the tree to
what pays at the rate it learns for copies after matches of their length, as for `lookup`.
"""

from __future__ import annotations

import heapq
from array import array
from collections import defaultdict
from itertools import islice

import torch

from dyspec.core.contract import AutoNeeds, Policy
from dyspec.core.copying import occurrences
from dyspec.core.draft import DraftSession
from dyspec.core.tree import Tree
from dyspec.errors import DyspecError

MAX_OCCURRENCES = 64  # the latest occurrences followed: older ones add little and cost a scan each
MAX_ANSWERS = 1000  # earlier answers kept for the search (the reference keeps 10,000 requests)

Paths = list[tuple[tuple[int, ...], int]]  # (path of tokens, its count), best first


def grow(tokens: array, ends: list[int], total: int, limit: int, min_prob: float, depth: int) -> tuple[Paths, float]:
    """The draft from the continuations after `ends` (each up to `depth` tokens, cut at a -1): up to
    `limit` paths by count, each of probability count / `total` >= `min_prob`; and its score, the
    sum of those probabilities."""
    counts: dict[tuple[int, ...], int] = {}
    for end in ends:
        path: tuple[int, ...] = ()
        for token in tokens[end : end + depth]:
            if token < 0:
                break
            path = (*path, token)
            counts[path] = counts.get(path, 0) + 1
    children: dict[tuple[int, ...], list] = defaultdict(list)
    for i, (path, c) in enumerate(counts.items()):  # by count, then the order they were found: latest first
        children[path[:-1]].append((-c, i, path))
    heap, paths = children[()], []
    heapq.heapify(heap)
    while heap and len(paths) < limit:
        c, _, path = heapq.heappop(heap)
        if -c / total < min_prob:  # a path is never likelier than its prefix: none after it passes
            break
        paths.append((path, -c))
        for child in children[path]:
            heapq.heappush(heap, child)
    return paths, sum(c for _, c in paths) / total


def remembered(draft: DraftSession) -> tuple[array, bytes]:
    """The pair's earlier answers, each followed by -1 (so that no match or copy spans two), as tokens
    and as their bytes; this generation's own joins them once the next generation starts (the first
    build that meets a new context)."""
    memo = draft.memo.setdefault("suffix", {"answers": [], "now": None, "start": 0})
    if memo["now"] is not draft.context:
        if memo["now"] is not None:
            memo["answers"] = [*memo["answers"], memo["now"][memo["start"] :]][-MAX_ANSWERS:]
            memo.pop("joined", None)
        memo["now"], memo["start"] = draft.context, len(draft.context)
    if "joined" not in memo:
        joined = array("i")
        for answer in memo["answers"]:
            joined.extend(answer)
            joined.append(-1)
        memo["joined"] = joined, joined.tobytes()
    return memo["joined"]


def forget(pair) -> None:
    """Clear the pair's earlier answers: the next generation searches its own context alone."""
    pair.memo.pop("suffix", None)


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
    max_spec_factor: float = 1.0,
    max_spec_offset: float = 0.0,
    min_token_prob: float = 0.1,
    free_budget: int | None = None,
) -> Tree:
    """The defaults are the reference's (vLLM's `suffix_decoding_*`: factor 1, offset 0, min token
    probability 0.1), but the match length, where the reference's tree allows 24 tokens in all."""
    if not 1 <= min_match <= max_match:
        raise DyspecError(f"suffix needs 1 <= min_match <= max_match, got min_match={min_match}, max_match={max_match}")
    if max_depth < 1:
        raise DyspecError(f"max_depth must be >= 1, got {max_depth}")
    if max_spec_factor < 0 or not 0 <= min_token_prob <= 1:
        raise DyspecError("suffix needs max_spec_factor >= 0 and min_token_prob in [0, 1]")
    cap = budget if free_budget is None else free_budget
    context = array("i", draft.context)
    own, (earlier, earlier_bytes) = context.tobytes(), remembered(draft)
    sources = [(context, own, len(own) - 4, 1), (earlier, earlier_bytes, len(earlier_bytes), 0)]
    best: tuple[float, int, Paths, int] = (0.0, 0, [], 1)
    for tokens, data, end, current in sources:
        for n in range(min_match, min(max_match, len(context) - 1) + 1):
            ends = list(islice(occurrences(data, own[-4 * n :], end), MAX_OCCURRENCES))
            if not ends:
                break  # no longer suffix occurs where this one does not
            limit = min(cap, int(n * max_spec_factor + max_spec_offset + 1e-6))
            total = len(ends) + current  # the occurrence being matched counts, as the reference's tree holds it
            paths, score = grow(tokens, ends, total, limit, min_token_prob, max_depth)
            if paths and score >= best[0]:
                best = (score, n, paths, total)
    _, match, paths, total = best
    tree = Tree.root(root, sampling="deterministic")
    node_of, count_of = {(): 0}, {(): total}
    for path, count in paths:  # a path comes after its prefix; an edge's probability is its share of its parent's count
        node_of[path] = tree.add(node_of[path[:-1]], path[-1], count / count_of[path[:-1]])
        count_of[path] = count
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
