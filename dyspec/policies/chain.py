"""A chain of K = budget draft tokens (Leviathan et al. 2023), drawn autoregressively from q."""

import torch

from dyspec.core.contract import Policy
from dyspec.core.draft import DraftSession
from dyspec.core.sampling import sample, to_probs
from dyspec.core.tree import Tree


def extend(tree: Tree, node: int, logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """Draw the chain's next token from the draft's logits after `node` and append it as one
    expansion; returns its column in the logits."""
    q = to_probs(logits, temperature)
    x = sample(q, generator)
    tree.q[node] = q
    # at T = 0, q is one-hot; the draft's own probability (T = 1) is what estimates acceptance
    q_x = q[x] if temperature > 0 else to_probs(logits, 1.0)[x]
    tree.add(node, tree.token_ids(torch.tensor(x), len(q)), float(q_x))
    tree.end_expansion()
    return x


def build(draft: DraftSession, root: int, budget: int, temperature: float, generator: torch.Generator) -> Tree:
    tree = Tree.root(root, "iid", draft.vocab)
    for node in range(budget):
        extend(tree, node, draft.logits(tree, [node])[0], temperature, generator)
    return tree


POLICY = Policy(
    "chain",
    build,
    needs_draft=True,
    summary="the draft's top guess, then its top guess after that: one path, no branches",
)
