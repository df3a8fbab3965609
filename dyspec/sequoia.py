"""Sequoia (Chen et al. 2024): the static tree that maximises expected accepted tokens per step,
given the positional acceptance vector a (a[k] = chance that the k-th drawn child is accepted)."""

from __future__ import annotations

import json
from functools import lru_cache

import numpy as np

from dyspec.errors import DyspecError


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


def acceptance_from_ranks(ranks: list[int | None], width: int) -> list[float]:
    """a[k] = fraction of steps whose accepted child was the k-th drawn (None: none accepted)."""
    if not ranks:
        raise DyspecError("no steps to measure acceptance from")
    counts = np.zeros(width)
    for r in ranks:
        if r is not None:
            counts[r] += 1
    return (counts / len(ranks)).tolist()


def load_acceptance(path) -> list[float]:
    return json.loads(path.read_text())["acceptance"]


def measure_acceptance(
    pair, prompts: list[str], temperature: float, width: int = 16, max_new_tokens: int = 32, progress: bool = True
) -> list[float]:
    """Positional acceptance of `pair` at `temperature`: decode with one-level trees of `width`
    children (drawn as the sequoia policy draws them) and histogram which child was accepted."""
    from tqdm.auto import tqdm

    from dyspec.engine import stream
    from dyspec.events import StepVerified

    one_level = [-1] + [0] * width
    ranks: list[int | None] = []
    for prompt in tqdm(prompts, desc=f"sequoia acceptance (T={temperature})", disable=not progress):
        for e in stream(
            pair,
            prompt,
            "sequoia",
            budget=width,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            options={"parents": one_level},
        ):
            if isinstance(e, StepVerified):
                ranks.append(e.accepted[0] - 1 if e.accepted else None)
    return acceptance_from_ranks(ranks, width)


def acceptance_for(pair, temperature: float, num_prompts: int = 10, width: int = 16) -> list[float]:
    """The measured acceptance vector of `pair` at `temperature`, cached on disk per model pair.
    Measured on IFEval prompts (never on the sets used to report speed)."""
    from dyspec.models import cache_dir, write_cache
    from dyspec.prompts import load_prompts

    safe = "__".join(str(x).replace("/", "_") for x in (pair.target_name, pair.draft_name, pair.device.type))
    path = cache_dir() / "sequoia" / f"{safe}__T{temperature:g}__w{width}.json"
    if path.exists():
        return load_acceptance(path)
    prompts = [p for _, p in load_prompts("ifeval", num_prompts)]
    acceptance = measure_acceptance(pair, prompts, temperature, width)
    write_cache(path, json.dumps({"acceptance": acceptance, "temperature": temperature, "prompts": len(prompts)}))
    return acceptance
