"""A chain of K = budget draft tokens (Leviathan et al. 2023), drawn autoregressively from q."""

import torch

from dyspec.draft import DraftSession
from dyspec.sampling import sample, to_probs
from dyspec.tree import Tree

NEEDS_DRAFT = True


def build(draft: DraftSession, root: int, budget: int, temperature: float, generator: torch.Generator) -> Tree:
    tree = Tree.root(root, sampling="iid")
    for node in range(budget):
        q = to_probs(draft.logits(tree, [node])[0], temperature)
        x = sample(q, generator)
        tree.q[node] = q
        tree.add(node, x, float(q[x]))
        tree.end_expansion()
    return tree
