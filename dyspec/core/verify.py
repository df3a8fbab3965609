"""Tree verification: pure functions over a `Tree` and the target's outputs at its nodes.

Each returns (accepted node ids along one root path, next token). The next token is the bonus
token at a leaf or the correction sampled after the last rejection; it has no KV yet and becomes
the next step's root.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dyspec.core.sampling import residual, sample
from dyspec.core.tree import Tree


def verify_greedy(tree: Tree, target_argmax: Sequence[int]) -> tuple[list[int], int]:
    """T = 0: follow the child carrying the target's argmax until there is none."""
    node, path = 0, []
    while True:
        o = int(target_argmax[node])
        child = next((c for c in tree.children(node) if tree.tokens[c] == o), None)
        if child is None:
            return path, o
        path.append(child)
        node = child


def verify_sampled(tree: Tree, p: torch.Tensor, generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """T > 0: multi-step speculative sampling over the tree; the target distribution is kept exactly.

    `p` is [len(tree), V]: the target's distribution after each node. At each node the children are
    tried in drawing order, each against the proposal it was actually drawn from:
    - "iid" (SpecInfer MSS): every child from q_u, or from its own draft's q when several drafts
      share the tree; duplicates stay separate trials;
    - "without_replacement" (Sequoia / DySpec): q_u with the earlier siblings removed;
    - "deterministic" (chosen, not sampled, e.g. top-k): a one-hot proposal on the child's token.
    After each rejection the target side becomes the residual norm(max(0, P - D)), D widened to the
    target's vocabulary where the draft's is reduced (dyspec.core.vocab).
    """
    node, path = 0, []
    while True:
        P = p[node]
        kids = tree.children(node)
        D = tree.widened(tree.q[node]).clone() if kids and tree.sampling == "without_replacement" else None
        accepted = None
        for s in kids:
            x = tree.tokens[s]
            r = float(torch.rand((), generator=generator, device=P.device))
            if tree.sampling == "deterministic":
                if r <= P[x]:
                    accepted = s
                    break
                P = P.clone()
                P[x] = 0
                P = P / P.sum()
                continue
            q = tree.proposal(s) if D is None else None
            d_x = float(D[x]) if D is not None else tree.prob(q, x)  # q is widened only where read whole
            if r * d_x <= float(P[x]):
                accepted = s
                break
            P = residual(P, D if D is not None else tree.widened(q))
            if D is not None:
                D[x] = 0
                total = D.sum()
                if total <= 0:
                    break
                D /= total
        if accepted is None:
            return path, sample(P, generator)
        path.append(accepted)
        node = accepted
