"""DySpec's threshold build (App. A.2): layer by layer, one batched draft forward per layer. A node
keeps drawing children (without replacement) while the value left for its next child exceeds t
(the paper prints `v < t`; it must be `v > t`). t defaults to 1 / budget (1/2 at budget 1: a lone
child must be likelier accepted than not); the budget caps the size."""

import torch

from dyspec.draft import DraftSession
from dyspec.errors import DyspecError
from dyspec.policies.common import child_mode
from dyspec.sampling import ranked_children, to_probs
from dyspec.tree import Tree

NEEDS_DRAFT = True
GROWS_BY_VALUE = True  # a bigger budget lowers the threshold: the smaller tree is the best part of the bigger


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
) -> Tree:
    t = 1 / max(budget, 2) if threshold is None else threshold
    if not 0 < t < 1:
        raise DyspecError(f"threshold must be in (0, 1), got {t}")
    sample, tau, sampling = child_mode(select, temperature, draft_temperature)
    tree = Tree.root(root, sampling)
    frontier = [0]
    while frontier and tree.size < budget:
        q = to_probs(draft.logits(tree, frontier), tau)
        tokens, probs = ranked_children(q, budget, sample, generator)
        next_frontier = []
        for i, u in enumerate(frontier):
            tree.q[u] = q[i]
            left = tree.values[u]  # value of u's next child slot
            for token, prob in zip(tokens[i].tolist(), probs[i].tolist()):
                if left <= t or prob <= 0 or tree.size >= budget:
                    break
                child = tree.add(u, token, prob)
                left -= tree.values[child]
                if tree.depths[child] < max_depth and tree.values[child] > t:
                    next_frontier.append(child)
        tree.end_expansion()
        frontier = sorted(next_frontier, key=lambda n: -tree.values[n])
    return tree
