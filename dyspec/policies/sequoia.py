"""Sequoia (Chen et al. 2024): the DP-optimal static tree for the pair's positional acceptance
vector a (a[k] = chance that the k-th drawn child is accepted), built layer by layer (one batched
draft forward per layer), children drawn without replacement (or the top-k at T = 0) and verified
without replacement. The vector is measured by `dyspec calibrate` (dyspec.eval.calibrate) and ships
for the default pair; this module only reads it."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from dyspec.cache import SHIPPED as SHIPPED_FILES
from dyspec.cache import cache_dir
from dyspec.core.contract import Policy
from dyspec.core.draft import DraftSession
from dyspec.core.programs import program
from dyspec.core.sampling import race_uniforms, ranked_children, to_probs, top_children
from dyspec.core.tree import Tree
from dyspec.core.tree_tensors import TreeTensors, index_on, new_tree, node_tensors, place_nodes
from dyspec.core.vocab import token_ids
from dyspec.errors import DyspecError
from dyspec.load import pair_key
from dyspec.policies.common import asks_device, child_mode, on_device_asked

SHIPPED = SHIPPED_FILES / "acceptance"  # vectors measured for the default pairs


@lru_cache(maxsize=64)
def optimal_tree(acceptance: tuple[float, ...], budget: int, max_depth: int) -> tuple[list[int], float]:
    """The best tree of at most `budget` drafted nodes and depth <= max_depth, as parent ids in
    breadth-first order (siblings in drawing order), and its expected tokens per step (bonus included).

    F[d][n]: best score of a subtree of n nodes (its root included) whose depth below the root is <= d;
    score = 1 for the subtree root + sum over children k of a[k] * F[d-1][size_k]. Children are filled
    in order: H[k][n] is the best for children k, k+1, ... using n nodes in all (Alg. 1 of the paper,
    with a depth bound)."""
    a = np.asarray(acceptance, dtype=np.float64)
    n_max, K = budget + 1, len(a)
    neg = -np.inf
    F = np.full((max_depth + 1, n_max + 1), neg)
    F[:, 1] = 1.0
    choice = {}  # (d, k, n) -> size of child k's subtree
    for d in range(1, max_depth + 1):
        H = np.full((K + 1, n_max + 1), neg)
        H[:, 0] = 0.0
        for k in range(K - 1, -1, -1):
            for n in range(1, n_max):
                m = np.arange(1, n + 1)
                sub = F[d - 1, m]
                # a child of acceptance 0 adds nothing, even where its subtree is impossible (0 * -inf)
                with np.errstate(invalid="ignore"):
                    scores = np.where(np.isneginf(sub), neg, a[k] * sub) + H[k + 1, n - m]
                best = int(np.argmax(scores))
                if scores[best] > neg:
                    H[k, n], choice[d, k, n] = scores[best], int(m[best])
        F[d, 2:] = 1.0 + H[0, 1:n_max]
        F[d, 1] = 1.0
    sizes = F[max_depth, 1:]
    n_best = 1 + int(np.argmax(sizes))  # more nodes never score less, but a tie keeps it smaller
    parents = [-1]
    queue = [(0, n_best, max_depth)]
    while queue:
        node, n, d = queue.pop(0)
        k, left = 0, n - 1
        while left > 0:
            m = choice[d, k, left]
            parents.append(node)
            queue.append((len(parents) - 1, m, d - 1))
            k, left = k + 1, left - m
    return parents, float(F[max_depth, n_best])


def tree_score(parents: list[int], acceptance: list[float]) -> float:
    """Expected tokens per step of a static tree: 1 + sum over nodes of the product of a along its path."""
    reach = [1.0]
    rank: dict[int, int] = {}
    for p in parents[1:]:
        k = rank.get(p, 0)
        rank[p] = k + 1
        reach.append(reach[p] * (acceptance[k] if k < len(acceptance) else 0.0))
    return sum(reach)


def acceptance_path(pair) -> Path:
    """Where `dyspec calibrate` writes the pair's vectors (it takes precedence over a shipped file)."""
    return cache_dir() / "acceptance" / f"{pair_key(pair)}.json"


def measured_vectors(pair) -> dict[float, list[float]]:
    """The pair's acceptance vectors by temperature: calibrated here, else shipped, else none."""
    for path in (acceptance_path(pair), SHIPPED / f"{pair_key(pair)}.json"):
        if path.is_file():
            return {float(t): a for t, a in json.loads(path.read_text())["acceptance"].items()}
    return {}


def available(pair) -> bool:
    return pair.draft is not None and bool(measured_vectors(pair))


def prepare(pair, temperature: float, options: dict) -> dict:
    """Fill in the pair's acceptance vector measured at the temperature nearest this one: the tree's
    shape only sets the speed, never the output's distribution."""
    if options.get("acceptance") is not None or options.get("parents") is not None:
        return options
    vectors = measured_vectors(pair)
    if not vectors:
        raise DyspecError(
            f"sequoia needs the acceptance vector of {pair.target_name} with {pair.draft_name}: measure it once "
            "with `dyspec calibrate` (same --target/--draft), or give one with --option acceptance=[0.6,0.2,...]"
        )
    return {**options, "acceptance": vectors[min(vectors, key=lambda t: abs(t - temperature))]}


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
    step: str = "host",
) -> Tree:
    """`parents` gives the static tree directly (breadth-first parent ids, root -1); otherwise it is
    the optimal tree for `acceptance`, `budget` and `max_depth`. `step`: "device" grows it with
    `grow`."""
    on_device_asked(step)
    parents = static_tree(acceptance, parents, budget, max_depth)
    sample, tau, sampling = child_mode(select, temperature, draft_temperature)
    tree = Tree.root(root, sampling, draft.vocab)
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], start=1):
        children.setdefault(p, []).append(i)
    # static node -> tree node, for the nodes of this layer that have children (an optimal tree can
    # have none: with acceptance (0, 0, ...) at budget 1)
    frontier = {0: 0} if children else {}
    while frontier:
        static = list(frontier)
        q = to_probs(draft.logits(tree, [frontier[s] for s in static]), tau)
        columns, probs = ranked_children(q, max(len(children[s]) for s in static), sample, generator)
        tokens, rows = tree.candidates(columns, probs, q.shape[-1])  # one host read for the layer
        next_frontier = {}
        for i, s in enumerate(static):
            u = frontier[s]
            tree.q[u] = q[i]
            for c, token, prob in zip(children[s], tokens[i], rows[i]):
                if prob <= 0:
                    break
                node = tree.add(u, token, prob)
                if c in children:
                    next_frontier[c] = node
        tree.end_expansion()
        frontier = next_frontier
    return tree


def static_tree(acceptance: list[float] | None, parents: list[int] | None, budget: int, max_depth: int) -> list[int]:
    """The tree's parent ids: `parents` as given (checked breadth-first), else the optimal tree."""
    if parents is None:
        return optimal_tree(tuple(acceptance), budget, max_depth)[0]
    if (
        parents[0] != -1
        or any(not 0 <= p < i for i, p in enumerate(parents[1:], 1))
        or parents[1:] != sorted(parents[1:])
    ):
        raise DyspecError(
            f"parents must list a tree breadth-first: -1 for the root, then each parent's id, in order; got {parents}"
        )
    return parents


def grow(
    draft: DraftSession, root: int, budget: int, temperature: float, generator: torch.Generator, options: dict
) -> TreeTensors:
    """`build`'s tree as tensor ops with no host read: a layer's nodes that have children are
    forwarded together and each child takes its rank among its parent's first k (top or drawn).
    The shape is static, so which row and rank each node takes is known here; a child of
    probability 0 is padding (`valid` False), as `build` stops at it."""
    o = options
    parents = static_tree(o["acceptance"], o["parents"], budget, o["max_depth"])
    sample, tau, sampling = child_mode(o["select"], temperature, o["draft_temperature"])
    device = draft.kv.device
    t = new_tree(root, len(parents), device, sampling, draft.vocab, compiled=draft.compiled)
    vocab = draft.vocab_columns(device)
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], start=1):
        children.setdefault(p, []).append(i)
    frontier = [0] if children else []
    logits = draft.logits(Tree.root(root, sampling, draft.vocab), [0], on_device=True) if frontier else None
    while frontier:
        k = max(len(children[s]) for s in frontier)
        # breadth-first, the layer's children are consecutive ids: each takes (its parent's row, its rank)
        kids = [c for s in frontier for c in children[s]]
        row = [i for i, s in enumerate(frontier) for _ in children[s]]
        rank = [j for s in frontier for j in range(len(children[s]))]
        places = index_on([row, rank, [parents[c] for c in kids]], device)
        uniforms = race_uniforms(logits.shape, generator, logits.device) if sample else None
        q = static_layer(logits, uniforms, tau, k, node_tensors(t), kids[0], places, *vocab, compiled=draft.compiled)
        t.q.append((q, frontier))
        t.growth.append(kids[-1] + 1)
        frontier = [c for c in kids if c in children]
        if frontier:
            logits = draft.tree_logits(t, frontier)
    return t


@program
def static_layer(
    logits: torch.Tensor,
    uniforms: torch.Tensor | None,
    tau: float,
    k: int,
    nodes: tuple[torch.Tensor, ...],
    start: int,
    places: torch.Tensor,
    vocab_ids: torch.Tensor | None,
    vocab_size: int,
) -> torch.Tensor:
    """A layer of the static tree, one program: the draft's q (returned) after the layer's forwarded
    nodes, their top or drawn (`uniforms`) k children, and each new node start.. placed at (its
    parent's row, its rank) of them, a child of probability 0 padding. `places`: [3, nodes] rows,
    ranks and parent ids."""
    q = to_probs(logits, tau)
    columns, probs = top_children(q, k, uniforms)
    tokens = token_ids(columns, q.shape[-1], vocab_ids, vocab_size)
    row, rank, parent = places
    p = probs[row, rank].double()
    place_nodes(nodes, start, parent, tokens[row, rank], p, p > 0)
    return q


POLICY = Policy(
    "sequoia",
    build,
    grow=grow,
    on_device=asks_device,
    needs_draft=True,
    prepare=prepare,
    available=available,
    summary="Sequoia: the static tree shape with the most expected accepted tokens for the budget, fixed in advance",
)
