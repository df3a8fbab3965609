"""A chain of K = budget draft tokens (Leviathan et al. 2023), drawn autoregressively from q."""

import math

import torch

from dyspec.core.contract import Policy
from dyspec.core.draft import DraftSession
from dyspec.core.sampling import sample, to_probs
from dyspec.core.tree import Tree
from dyspec.errors import DyspecError
from dyspec.kernels.row_stats import row_stats


def extend(tree: Tree, node: int, logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """Draw the chain's next token from the draft's logits after `node` and append it as one
    expansion; returns its column in the logits. At T = 0 the draw is the argmax, and q (one-hot) is
    not kept: greedy verification never reads it, and each op here runs at every draft node."""
    if temperature == 0:
        best, log_z = row_stats(logits)
        x = int(best)
        # the draft's own probability (T = 1), what estimates acceptance: exp(logit - logsumexp)
        q_x = math.exp(float(logits[x]) - float(log_z))
    else:
        q = tree.q[node] = to_probs(logits, temperature)
        x = sample(q, generator)
        q_x = float(q[x])
    tree.add(node, tree.token_id(x, len(logits)), q_x)
    tree.end_expansion()
    return x


def check_confidence(confidence: float) -> None:
    if not 0 <= confidence < 1:
        raise DyspecError(f"confidence must be in [0, 1), got {confidence}")


def build(
    draft: DraftSession,
    root: int,
    budget: int,
    temperature: float,
    generator: torch.Generator,
    *,
    confidence: float = 0.0,
) -> Tree:
    """`confidence`: stop early, once the chain's value (the product of its draft probabilities, the
    chance its last token is reached) falls below it: each further token costs a draft forward and
    a row of the target's, and pays only where it is likely reached. The stop reads the draft alone,
    so the outputs keep the target's distribution."""
    check_confidence(confidence)
    tree = Tree.root(root, "iid", draft.vocab)
    for node in range(budget):
        extend(tree, node, draft.logits(tree, [node])[0], temperature, generator)
        if tree.values[-1] < confidence:
            break
    return tree


POLICY = Policy(
    "chain",
    build,
    needs_draft=True,
    summary="the draft's top guess, then its top guess after that: one path, no branches",
)
