"""DySpec (Xiong et al. 2024), Alg. 1: a tree grown greedily by estimated acceptance.

A max-heap of sampling slots. A slot of node u yields u's next child (drawn without replacement
from q_u); its value is the chance of reaching that child's place, v_u * (1 - mass of the siblings
drawn before) when sampling, or the child's own value v_u * q_u[y] when taking the top-k. Popping
the best slot adds a node and pushes u's next-sibling slot; the new node's first-child slot needs
its draft distribution, so new nodes wait until the end of the round, when one draft forward
serves them all. A round pops up to `batch` slots; batch=1 is the paper's sequential algorithm.
Under `--budget auto` with sampled children the heap values a slot by what auto has learnt instead.

`grow` is the same tree as a tensor program on the draft's device (dyspec.core.tree_tensors), for
the step on the device: where a slot's value falls with its rank, as with the draft's and the
head's scores, the heap's `batch` pops of a round are the top `batch` of every unpopped
candidate's slot value (new nodes' slots join only the round after), ties to the lower node id,
then the lower rank, as the heap's (value, node) order breaks them. Where it need not fall (auto's
learnt rates), a slot is keyed by the least value from its node's next slot to it, and the top
`batch` keys are still the heap's pops. `build`, node by node, is its reference.
"""

import heapq
import math

import torch

from dyspec.core.contract import AutoNeeds, Policy, slot_rate
from dyspec.core.draft import DraftSession
from dyspec.core.programs import program
from dyspec.core.sampling import race_uniforms, ranked_children, to_probs, top_children
from dyspec.core.tree import Tree
from dyspec.core.tree_tensors import TreeTensors, new_tree, node_tensors, place_nodes
from dyspec.core.vocab import token_ids
from dyspec.errors import DyspecError
from dyspec.load.head import AcceptanceHead, head_for, head_on, load_head
from dyspec.policies.common import (
    asks_device,
    child_mode,
    drawn_slot,
    drawn_slots,
    learnt_scores,
    learnt_worth,
    on_device_asked,
)

SCORES = ("draft", "head")


def prepare(pair, temperature: float, options: dict) -> dict:
    """With score="head", resolve the acceptance head (the `head` option's file, else the shipped one)."""
    if options.get("score") == "head":
        return {**options, "head": head_for(pair, options.get("head"))}
    return options


def _head(score: str, head: str | None) -> AcceptanceHead | None:
    if score not in SCORES:
        raise DyspecError(f"score must be one of {', '.join(SCORES)}, got '{score}'")
    if score == "draft":
        return None
    if head is None:
        raise DyspecError("score=head needs an acceptance head (the `head` option, or one shipped for the pair)")
    return load_head(head)[0]


def _batch(budget: int, batch: int | None) -> int:
    batch = math.ceil(budget / 4) if batch is None else batch
    if batch < 1:
        raise DyspecError(f"batch must be at least 1, got {batch}")
    return batch


def forwards_for(budget: int, options: dict) -> int:
    """Draft forwards a tree of `budget` nodes takes: 4 at the default batch whatever the budget, so
    `--budget auto` prices a smaller tree by its width, not by the forwards of a prefix of this one."""
    batch = options.get("batch") or math.ceil(budget / 4)
    return math.ceil(budget / batch)


class DraftScore:
    """The paper's estimate: the chance of reaching node u is v_u, the product of draft
    probabilities on its path (`Tree.values`)."""

    def __init__(self, tree: Tree, sample: bool):
        self.tree, self.sample = tree, sample

    def reach(self, u: int) -> float:
        return self.tree.values[u]

    def slot(self, u: int, k: int, probs: list[float]) -> float:
        return drawn_slot(probs, k, self.sample)

    def forwarded(self, draft: DraftSession, new: list[int], logits: torch.Tensor, q: torch.Tensor, tokens) -> None:
        pass

    def added(self, u: int, k: int, child: int, value: float, probs: list[float]) -> None:
        pass

    def finish(self) -> None:
        pass


class HeadScore(DraftScore):
    """SpecDec++'s acceptance head instead of draft probabilities: the chance of reaching a node is
    the product of the head's predictions on its path. A prediction needs the draft's hidden state
    at the node, so it exists once the node is forwarded and scores its descendants only: it never
    decides whether the node itself is kept, which keeps sampling exact."""

    def __init__(self, tree: Tree, sample: bool, head: AcceptanceHead):
        super().__init__(tree, sample)
        self.head, self.reached, self.predicted = head, {0: 1.0}, {}
        self.q1: dict[int, float] = {}  # node -> the draft's T = 1 probability of its token (the head's input)
        self.ranked_q1: dict[int, list[float]] = {}  # node -> T = 1 probabilities of its ranked candidates

    def reach(self, u: int) -> float:
        return self.reached[u]

    def forwarded(self, draft, new, logits, q, tokens) -> None:
        self.ranked_q1.update(zip(new, to_probs(logits, 1.0).gather(1, tokens).tolist()))
        if new != [0]:
            accept = self.head.accept_prob(draft.hidden, torch.tensor([self.q1[n] for n in new]))
            for node, a in zip(new, accept.tolist()):
                self.predicted[node] = a
                self.reached[node] = self.reached[self.tree.parents[node]] * a

    def added(self, u, k, child, value, probs) -> None:
        self.q1[child] = self.ranked_q1[u][k]

    def finish(self) -> None:
        self.tree.extra = {"predicted_acceptance": [self.predicted.get(n) for n in range(1, len(self.tree))]}


class LearntScore(DraftScore):
    """Under `--budget auto` with sampled children: a slot is worth the chance of reaching its
    parent times the rate auto learnt for its bin, the value auto's cut will give its node. The
    paper's 1 - mass prices a later sibling by the mass left, far above its chance
    (`budget.node_bins`), so the heap spent its pops on siblings the cut then dropped. A slot's bin
    is known before its draw (q's sum of squares less the earlier siblings'), so this stays exact."""

    def __init__(self, tree: Tree, sample: bool, rates: list[float]):
        super().__init__(tree, sample)
        self.rates, self.reached = rates, {0: 1.0}
        self.key_left: dict[int, float] = {}  # node -> sum of q^2 over the tokens its children have not taken

    def reach(self, u: int) -> float:
        return self.reached[u]

    def slot(self, u, k, probs) -> float:
        return slot_rate(self.rates, self.key_left[u], later=k > 0)

    def forwarded(self, draft, new, logits, q, tokens) -> None:
        self.key_left.update(zip(new, q.square().sum(-1).tolist()))

    def added(self, u, k, child, value, probs) -> None:
        self.reached[child] = value
        self.key_left[u] -= probs[k] ** 2


def build(
    draft: DraftSession,
    root: int,
    budget: int,
    temperature: float,
    generator: torch.Generator,
    *,
    batch: int | None = None,
    max_depth: int = 16,
    select: str = "auto",
    draft_temperature: float = 0.6,
    score: str = "draft",
    head: str | None = None,
    auto_rates: list[float] | None = None,
    step: str = "host",
) -> Tree:
    """Algorithm 1: pop the most valuable slot, add its child, push the parent's next slot, and
    forward each round's new nodes together for their own first slots.
    `batch`: slots popped per draft forward (default budget / 4: 4 draft forwards a step, so the
    tree is at most 4 deep; batch=1 has no such cap but costs a draft forward per node).
    `select`: "sample" draws children without replacement from the draft (at `draft_temperature`
    when T = 0, at T otherwise), "top" takes them by draft probability, "auto" is "top" at T = 0
    and "sample" at T > 0.
    `score`: what estimates the chance of reaching a node: "draft", the product of draft
    probabilities on its path (the paper, `DraftScore`); "head", the product of SpecDec++
    acceptance-head predictions (`HeadScore`; `head`: its file, else the one shipped for the pair).
    `auto_rates` (set by the engine under `--budget auto`): with sampled children and
    score="draft", slots are valued by the rates auto learnt (`LearntScore`).
    A tree takes at most `forwards_for` draft forwards; a round whose picks all sit at `max_depth`
    forwards nothing and still pops. `step`: "device" grows it with `grow` where `on_device` says
    it can; "host", the default (faster on a CPU: docs/results/cpu-device-step.md), here."""
    batch = _batch(budget, batch)
    sample, tau, sampling = child_mode(select, temperature, draft_temperature)
    on_device_asked(step)
    acceptance_head = _head(score, head)
    tree = Tree.root(root, sampling, draft.vocab)
    if acceptance_head is not None:
        scorer = HeadScore(tree, sample, acceptance_head)
    elif auto_rates is not None and sample:
        scorer = LearntScore(tree, sample, auto_rates)
    else:
        scorer = DraftScore(tree, sample)
    ranked: dict[int, tuple[list[int], list[float]]] = {}  # node -> its children candidates in order
    drawn: dict[int, int] = {}  # node -> children added so far
    heap: list[tuple[float, int]] = []  # (-slot value, node)

    def push_slot(u: int) -> None:
        (tokens, probs), k = ranked[u], drawn[u]
        if k < len(tokens) and probs[k] > 0:
            heapq.heappush(heap, (-scorer.reach(u) * scorer.slot(u, k, probs), u))

    new = [0]
    for _ in range(forwards_for(budget, {"batch": batch})):
        if new:  # the nodes of the round before, each for its first slot
            logits = draft.logits(tree, new)
            q = to_probs(logits, tau)
            columns, probs = ranked_children(q, budget, sample, generator)
            scorer.forwarded(draft, new, logits, q, columns)
            tokens, rows = tree.candidates(columns, probs, q.shape[-1])  # one host read for the round
            for i, node in enumerate(new):
                tree.q[node] = q[i]
                ranked[node], drawn[node] = (tokens[i], rows[i]), 0
                push_slot(node)
        new = []
        for _ in range(batch):
            if not heap or tree.size >= budget:
                break
            neg_value, u = heapq.heappop(heap)
            (tokens_u, probs_u), k = ranked[u], drawn[u]
            child = tree.add(u, tokens_u[k], probs_u[k])
            scorer.added(u, k, child, -neg_value, probs_u)
            drawn[u] = k + 1
            push_slot(u)
            if tree.depths[child] < max_depth:
                new.append(child)
        tree.end_expansion()
    scorer.finish()
    return tree


def grow(
    draft: DraftSession, root: int, budget: int, temperature: float, generator: torch.Generator, options: dict
) -> TreeTensors:
    """`build`'s tree grown as tensor ops with no host read: each round forwards the last round's
    `batch` picks (padding too, `valid` False, so that every round has one shape) and picks the next
    `batch` from the candidate matrix of every node forwarded so far, a slot valued as `drawn_slot`
    does times the chance of reaching its node: its value, or with score="head" the product of the
    head's predictions on its path (`HeadScore`), made on the draft's device from each round's
    hidden states, or under `--budget auto` with sampled children by the rates auto learnt
    (`LearntScore`, `auto_rates` in `options`). A round is one program (`heap_round`), either way.
    Where the policy's `on_device` says so."""
    batch, max_depth = _batch(budget, options["batch"]), options["max_depth"]
    sample, tau, sampling = child_mode(options["select"], temperature, options["draft_temperature"])
    rounds = forwards_for(budget, {"batch": batch})
    device = draft.kv.device
    t = new_tree(root, 1 + rounds * batch, device, sampling, draft.vocab, compiled=draft.compiled)
    nodes = node_tensors(t)
    head = _head(options["score"], options["head"])
    head = None if head is None else head_on(head, device)
    # `LearntScore`'s where the host's build would use it
    learnt = learnt_scores(options.get("auto_rates"), len(t), device) if head is None and sample else None
    if head is not None:  # the head's inputs, the draft's T = 1 probabilities: each node's, each candidate's
        reach, q1 = torch.ones(len(t), dtype=torch.float64, device=device), torch.zeros(len(t), device=device)
        t.extra["predicted_acceptance"] = torch.full((len(t),), math.nan, dtype=torch.float64, device=device)
    ids, size = draft.vocab_columns(device)
    logits = draft.logits(Tree.root(root, sampling, draft.vocab), [0], on_device=True)
    # candidates [nodes, k] of every node (target token ids), their probabilities and slot values,
    # -inf until forwarded
    k = min(budget, logits.shape[-1])
    slots, *candidates = heap_start(len(t), k, device, compiled=draft.compiled)
    q1_candidates = None if head is None else torch.zeros(len(t), k, device=device)
    shape = (batch, budget, max_depth, sample)
    # every round's race in one draw, a row per node forwarded: the stream the host draws forward by forward
    race = (1 + (rounds - 1) * batch, logits.shape[-1])
    uniforms = race_uniforms(race, generator, device) if sample else None
    for r in range(rounds):
        forwarded = (0, 1) if r == 0 else (1 + (r - 1) * batch, 1 + r * batch)  # the last round's picks
        new = 1 + r * batch
        scores = None
        if head is not None:  # the root's forward predicts nothing: it is the target's own token
            scores = (head, None if r == 0 else draft.hidden, reach, q1, q1_candidates, t.extra["predicted_acceptance"])
        args = (logits, uniforms, tau, ids, size, nodes, slots, candidates, forwarded, new, shape, scores, learnt)
        q = heap_round(*args, compiled=draft.compiled)
        t.q.append((q, list(range(*forwarded))))
        t.growth.append(new + batch)
        if r + 1 < rounds:
            logits = draft.tree_logits(t, list(range(new, new + batch)))
    return t


def _candidates(logits, uniforms, tau, ids, size, candidates, forwarded):
    """The draft's q (returned) after the nodes `forwarded` (first, stop) from their `logits`, and its
    top or drawn (their rows of `uniforms`) children (returned): their target token ids and
    probabilities go into the `candidates` matrices' rows of those nodes."""
    q = to_probs(logits, tau)
    rows = slice(*forwarded)
    columns, probs = top_children(q, candidates[0].shape[1], None if uniforms is None else uniforms[rows])
    candidates[0][rows] = token_ids(columns, q.shape[-1], ids, size)
    candidates[1][rows] = probs.double()
    return q, columns


def _pick(nodes, slots, candidates, reach, forwarded, new, shape, worth=None):
    """A round's `batch` picks added to the tree as nodes new.., after the slots of the nodes
    `forwarded` join the candidates' `slots`, each valued by its node's `reach` times its `worth`
    (None: `drawn_slot`'s); returns the picks and their values. A node's slots pop in rank order, so
    each is keyed by the least value from its node's next slot to it: the top `batch` keys are the
    heap's `batch` pops (ties to the lower node id, then rank) even where a slot's value does not
    fall with its rank (auto's learnt rates)."""
    batch, budget, max_depth, sample = shape
    tokens, p = candidates
    _, _, depths, _, _, valid, _ = nodes
    rows = slice(*forwarded)
    live = (p[rows] > 0) & (valid[rows] & (depths[rows] < max_depth))[:, None]
    worth = drawn_slots(p[rows], sample) if worth is None else worth
    slots[rows] = torch.where(live, reach[rows, None] * worth, -math.inf)
    keys = torch.where(slots < math.inf, slots.cummin(1).values, -math.inf).flatten()  # popped: +inf
    picks = keys.sort(descending=True, stable=True).indices[:batch]
    room = budget + 1 - valid.sum()  # the budget's nodes not added yet (the root is valid), as a tensor: no read
    taken = (keys[picks] > -math.inf) & (torch.arange(batch, device=slots.device) < room)
    place_nodes(nodes, new, picks // slots.shape[1], tokens.flatten()[picks], p.flatten()[picks], taken)
    values = slots.flatten()[picks]
    slots.view(-1)[picks] = math.inf
    return picks, values


@program
def heap_start(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The heap's slot values [n, k] (-inf: none yet), and its candidates' token ids and probabilities."""
    slots = torch.full((n, k), -math.inf, dtype=torch.float64, device=device)
    return slots, torch.zeros(n, k, dtype=torch.long, device=device), torch.zeros_like(slots)


@program
def heap_round(
    logits: torch.Tensor,
    uniforms: torch.Tensor | None,
    tau: float,
    ids: torch.Tensor | None,
    size: int,
    nodes: tuple[torch.Tensor, ...],
    slots: torch.Tensor,
    candidates: list[torch.Tensor],
    forwarded: tuple[int, int],
    new: int,
    shape: tuple[int, int, int, bool],
    scores: tuple | None,
    learnt: tuple | None,
) -> torch.Tensor:
    """A round of the heap, one program: `_candidates`, then `_pick` by each node's value, or with
    the head's `scores` (`HeadScore`) by its reach: the head's predictions for the nodes
    `forwarded` from their final `hidden` states (None for the root's forward) go into their
    `reach` and `predicted` first. `q1`, `q1_candidates`: the draft's T = 1 probabilities of each
    node's token and of each candidate, the head's inputs. With `learnt` (`LearntScore`: the rates
    auto learnt, each node's reach) by those rates. Returns the draft's q after the nodes `forwarded`."""
    q, columns = _candidates(logits, uniforms, tau, ids, size, candidates, forwarded)
    if learnt is not None:  # a pick's value is the chance of reaching it
        rates, reach = learnt
        worth = learnt_worth(q, candidates[1][slice(*forwarded)], rates)
        reach[new : new + shape[0]] = _pick(nodes, slots, candidates, reach, forwarded, new, shape, worth)[1]
        return q
    if scores is None:
        _pick(nodes, slots, candidates, nodes[4], forwarded, new, shape)
        return q
    head, hidden, reach, q1, q1_candidates, predicted = scores
    batch, _, max_depth, _ = shape
    rows = slice(*forwarded)
    q1_candidates[rows] = to_probs(logits, 1.0).gather(1, columns)
    if hidden is not None:
        accept = head.calibrated(hidden, q1[rows]).double()
        reach[rows] = reach[nodes[1][rows]] * accept
        predicted[rows] = torch.where(nodes[2][rows] < max_depth, accept, math.nan)  # the host forwards no deeper
    picks = _pick(nodes, slots, candidates, reach, forwarded, new, shape)[0]
    q1[new : new + batch] = q1_candidates.flatten()[picks]
    return q


POLICY = Policy(
    "dyspec",
    build,
    grow=grow,
    on_device=asks_device,
    needs_draft=True,
    prepare=prepare,
    auto=AutoNeeds(rates=True, grows_by_value=True, forwards_for=forwards_for),
    summary="DySpec: grows the tree one node at a time where the draft is most confident (highest path probability)",
)
