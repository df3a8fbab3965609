"""SpecDec++ (Huang et al. 2024): a chain whose length K adapts. After each drafted token, the
acceptance head reads the draft's hidden state at that token; drafting stops once the predicted
chance that at least one drafted token is rejected, 1 - prod(predicted acceptance), passes h,
keeping the token that the predicting forward drew (as the official code does).
Verification is plain chain speculative sampling, so the output is exact whatever the head says."""

import math

import torch

from dyspec.core.contract import Policy
from dyspec.core.draft import DraftSession
from dyspec.core.programs import program
from dyspec.core.tree import Tree
from dyspec.core.tree_tensors import TreeTensors
from dyspec.errors import DyspecError
from dyspec.load.head import AcceptanceHead, head_for, head_on, load_head, shipped_head
from dyspec.policies.chain import extend, grow_chain
from dyspec.policies.common import asks_device, on_device_asked


def available(pair) -> bool:
    return pair.draft is not None and shipped_head(pair).is_file()


def prepare(pair, temperature: float, options: dict) -> dict:
    """Resolve the head: the `head` option's file, else the head shipped for this model pair."""
    return {**options, "head": head_for(pair, options.get("head"))}


def check(h: float, min_k: int, max_k: int, head: str | None) -> None:
    if not 0 < h < 1:
        raise DyspecError(f"h must be between 0 and 1, got {h}")
    if not 1 <= min_k <= max_k:
        raise DyspecError(f"need 1 <= min_k <= max_k, got min_k={min_k}, max_k={max_k}")
    if head is None:
        raise DyspecError("specdecpp needs an acceptance head (the `head` option, or one shipped for the pair)")


def build(
    draft: DraftSession,
    root: int,
    budget: int,
    temperature: float,
    generator: torch.Generator,
    *,
    h: float = 0.5,
    min_k: int = 2,
    max_k: int = 20,
    head: str | None = None,
    step: str = "host",
) -> Tree:
    """Draft K tokens, min_k <= K <= min(max_k, budget), as the official loop does
    (Kaffaljidhmah2/SpecDec_pp, `specdec_pp/hf_generation.py`, the `ada` schedule): each draft
    forward, over the last drafted token, gives the next token and the head's prediction for that
    last token; the next token is kept, and drafting stops there once K >= min_k and
    1 - prod(predictions) > h, so a stop costs no further draft forward. The root's forward
    predicts nothing (the root is the target's own token). `tree.extra["predicted_acceptance"][i]`
    is the head's prediction for node i + 1 (None for the last node, never forwarded).
    `step`: "device" grows it with `grow`."""
    check(h, min_k, max_k, head)
    on_device_asked(step)
    acceptance_head, _ = load_head(head)
    tree = Tree.root(root, "iid", draft.vocab)
    predicted: list[float | None] = []
    survive = 1.0  # predicted chance that every token drafted so far is accepted
    q_last = torch.ones(())  # the draft's probability (T = 1) of the last drafted token
    for node in range(min(max_k, budget)):
        logits = draft.logits(tree, [node])[0]
        if node > 0:
            predicted.append(float(acceptance_head.accept_prob(draft.hidden[-1], q_last)))
            survive *= predicted[-1]
        x = extend(tree, node, logits, temperature, generator)
        q_last = torch.softmax(logits.float(), dim=-1)[x]
        if tree.size >= min_k and 1 - survive > h:
            break
    tree.extra = {"predicted_acceptance": predicted + [None] * (tree.size - len(predicted))}
    return tree


def grow(
    draft: DraftSession, root: int, budget: int, temperature: float, generator: torch.Generator, options: dict
) -> TreeTensors:
    """`build`'s chain as tensor ops with no host read (`chain.grow_chain`): min(max_k, budget) nodes,
    every one forwarded, those past the stop padding; the head's predictions, on the draft's device,
    multiply into the chance that all so far are accepted as the host's floats do (float64), a
    program a node (`head_stop`)."""
    h, min_k, max_k, path = (options[name] for name in ("h", "min_k", "max_k", "head"))
    check(h, min_k, max_k, path)
    device = draft.kv.device
    head = head_on(load_head(path)[0], device)
    length = min(max_k, budget)
    # the head's predictions, their product so far and the draft's probability (T = 1) of the chain's
    # last token, as `build` hands it to the head: made by the first link's program
    predicted = survive = q_last = None

    def goes_on(node, logits, column):
        nonlocal predicted, survive, q_last
        if node == 1:
            q_last, survive, predicted, live = first_stop(logits, column, length, compiled=draft.compiled)
            return live
        args = (head, draft.hidden, q_last, survive, predicted, node, h, min_k, logits, column)
        live, q_last = head_stop(*args, compiled=draft.compiled)
        return live

    t = grow_chain(draft, root, length, temperature, generator, goes_on=goes_on)
    t.extra["predicted_acceptance"] = chain_predictions(t.valid, predicted, compiled=draft.compiled)
    return t


@program
def token_prob(logits: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """The draft's probability at T = 1 of the token drawn as `column` [1] of its `logits` [1, V], 0-d
    as `build` hands it to the head (a 0-d index would be a read: a gather)."""
    return torch.softmax(logits.float(), dim=-1).gather(1, column[:, None]).reshape(())


@program
def first_stop(
    logits: torch.Tensor, column: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Past the chain's node 1, drawn as `column` of the root's forward's `logits`, which predicts
    nothing (the root is the target's own token): its token's probability, the product of the
    predictions (1), room for the predictions of a chain of `length` (NaN) and the chain going on."""
    survive = torch.ones(1, dtype=torch.float64, device=logits.device)
    predicted = torch.full((length + 1,), math.nan, dtype=torch.float64, device=logits.device)
    return token_prob(logits, column), survive, predicted, survive > 0


@program
def chain_predictions(valid: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """The head's prediction for each node past the root: none for padding, nor for the chain's last
    node, as in `build`, which never forwards it (here a padding node's forward did)."""
    return torch.cat([torch.where(valid[1:], predicted[:-1], math.nan), predicted[-1:]])


@program
def head_stop(
    head: AcceptanceHead,
    hidden: torch.Tensor,
    q_last: torch.Tensor,
    survive: torch.Tensor,
    predicted: torch.Tensor,
    node: int,
    h: float,
    min_k: int,
    logits: torch.Tensor,
    column: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Past the chain's new `node` (> 1), drawn as `column` of the draft's `logits` by a forward over
    node - 1 with final hidden states `hidden` [1, H]: the head's prediction for node - 1 (whose
    token's T = 1 probability is `q_last`) into `predicted` and, multiplied, into `survive` (in
    place); returns whether the chain goes on past `node`, [1] bool, and the new token's probability."""
    accept = head.calibrated(hidden[-1], q_last).double()
    predicted[node - 1 : node] = accept
    survive.mul_(accept)
    return (1 - survive <= h) | (node < min_k), token_prob(logits, column)


POLICY = Policy(
    "specdecpp",
    build,
    grow=grow,
    on_device=asks_device,
    needs_draft=True,
    prepare=prepare,
    available=available,
    summary="SpecDec++: a chain that stops drafting where a trained head predicts a rejection",
)
