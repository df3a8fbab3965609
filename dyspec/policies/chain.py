"""A chain of K = budget draft tokens (Leviathan et al. 2023), drawn autoregressively from q."""

import math
from collections.abc import Callable

import torch

from dyspec.core.contract import Policy
from dyspec.core.draft import DraftSession
from dyspec.core.programs import program
from dyspec.core.sampling import sample, to_probs
from dyspec.core.tree import Tree
from dyspec.core.tree_tensors import TreeTensors, new_tree, node_tensors, place_nodes
from dyspec.core.vocab import token_ids
from dyspec.errors import DyspecError
from dyspec.kernels.row_stats import inverse_cdf, row_stats
from dyspec.policies.common import asks_device, on_device_asked


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
    step: str = "host",
) -> Tree:
    """`confidence`: stop early, once the chain's value (the product of its draft probabilities, the
    chance its last token is reached) falls below it: each further token costs a draft forward and
    a row of the target's, and pays only where it is likely reached. The stop reads the draft alone,
    so the outputs keep the target's distribution. `step`: "device" grows it with `grow`."""
    check_confidence(confidence)
    on_device_asked(step)
    tree = Tree.root(root, "iid", draft.vocab)
    for node in range(budget):
        extend(tree, node, draft.logits(tree, [node])[0], temperature, generator)
        if tree.values[-1] < confidence:
            break
    return tree


def grow(
    draft: DraftSession, root: int, budget: int, temperature: float, generator: torch.Generator, options: dict
) -> TreeTensors:
    """`build`'s chain as tensor ops with no host read (`grow_chain`), the confidence stop as padding."""
    confidence = options["confidence"]
    check_confidence(confidence)
    return grow_chain(draft, root, budget, temperature, generator, confidence)


def grow_chain(
    draft: DraftSession,
    root: int,
    length: int,
    temperature: float,
    generator: torch.Generator,
    confidence: float = 0.0,
    goes_on: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> TreeTensors:
    """A chain of `length` drafted nodes as tensor ops with no host read, each drawn as `extend` draws
    it. The chain goes on past a node while its value is at least `confidence`, or, given
    `goes_on(node, logits, column)`, while that says so as a bool tensor [1] (the new `node` drawn as
    `column` of the draft's `logits`); where it stops, the nodes after are padding (`valid` False),
    still forwarded, so that the chain has one shape."""
    device = draft.kv.device
    t = new_tree(root, length + 1, device, "iid", draft.vocab, compiled=draft.compiled)
    live = None  # the root's child is drafted whatever comes after
    vocab = draft.vocab_columns(device)
    logits = draft.logits(Tree.root(root, "iid", draft.vocab), [0], on_device=True)
    # every link's uniform in one draw outside the programs, which take no generator: a row a link,
    # the stream `extend` draws link by link
    u = torch.rand((length, 1), dtype=torch.float64, generator=generator, device=device) if temperature else None
    for node in range(length):
        args = (logits, temperature, u, node_tensors(t), node, live, confidence, *vocab)
        q, best, live = link(*args, compiled=draft.compiled)
        if q is not None:
            t.q.append((q, [node]))
        t.growth.append(node + 2)
        if goes_on is not None:
            live = goes_on(node + 1, logits, best)
        if node + 1 < length:
            logits = draft.tree_logits(t, [node + 1])
    return t


@program
def link(
    logits: torch.Tensor,
    temperature: float,
    u: torch.Tensor | None,
    nodes: tuple[torch.Tensor, ...],
    node: int,
    live: torch.Tensor | None,
    confidence: float,
    vocab_ids: torch.Tensor | None,
    vocab_size: int,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The chain's next node, node + 1, after `node`, one program, as `extend` draws it: at T = 0
    (`u` None) the draft's argmax, valued at T = 1 in float64; at T > 0 drawn from the draft's q at
    `temperature` at the uniform `u[node]` (`u` [length, 1]: `sample_rows`' inverse CDF). Added to
    the tree's `nodes`, valid where `live` (None: yes); returns q (None at T = 0, where verification
    never reads it), the draw's column and whether the chain goes on past it (`place_link`)."""
    if u is None:
        best, log_z = row_stats(logits)
        q, q_x = None, (logits.gather(1, best[:, None])[:, 0].double() - log_z.double()).exp()
    else:
        q = to_probs(logits, temperature)
        best = inverse_cdf(q, u[node : node + 1])[:, 0]
        q_x = q.gather(1, best[:, None])[:, 0].double()
    if live is None:
        live = torch.ones(1, dtype=torch.bool, device=logits.device)
    return q, best, place_link(nodes, node, best, q_x, live, confidence, logits.shape[-1], vocab_ids, vocab_size)


def place_link(
    nodes: tuple[torch.Tensor, ...],
    node: int,
    column: torch.Tensor,
    q_x: torch.Tensor,
    live: torch.Tensor,
    confidence: float,
    width: int,
    vocab_ids: torch.Tensor | None,
    vocab_size: int,
) -> torch.Tensor:
    """Node node + 1, the token of the draft's `column` of distributions `width` wide drawn with
    probability `q_x`, a child of `node` (valid where `live`), into the tree's `nodes`; returns
    whether the chain goes on past it, [1] bool: while its value is at least `confidence`, as
    `build` stops (past an invalid node, its children are invalid anyway)."""
    parent = torch.full((1,), node, dtype=torch.long, device=column.device)
    place_nodes(nodes, node + 1, parent, token_ids(column, width, vocab_ids, vocab_size), q_x, live)
    return nodes[4][node + 1 : node + 2] >= confidence


POLICY = Policy(
    "chain",
    build,
    grow=grow,
    on_device=asks_device,
    needs_draft=True,
    summary="the draft's top guess, then its top guess after that: one path, no branches",
)
