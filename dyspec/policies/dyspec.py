"""DySpec (Xiong et al. 2024), Alg. 1: a tree grown greedily by estimated acceptance.

A max-heap of sampling slots. A slot of node u yields u's next child (drawn without replacement
from q_u); its value is the chance of reaching that child's place, v_u * (1 - mass of the siblings
drawn before) when sampling, or the child's own value v_u * q_u[y] when taking the top-k. Popping
the best slot adds a node and pushes u's next-sibling slot; the new node's first-child slot needs
its draft distribution, so new nodes wait until the end of the round, when one draft forward
serves them all. A round pops up to `batch` slots; batch=1 is the paper's sequential algorithm.
Under `--budget auto` with sampled children the heap values a slot by what auto has learnt instead.
"""

import heapq
import math

import torch

from dyspec.auto.budget import slot_rate
from dyspec.core.draft import DraftSession
from dyspec.core.sampling import ranked_children, to_probs
from dyspec.core.tree import Tree
from dyspec.errors import DyspecError
from dyspec.models.head import AcceptanceHead, head_for, load_head
from dyspec.policies.common import child_mode
from dyspec.policies.contract import Policy

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


def forwards_for(budget: int, options: dict) -> int:
    """Draft forwards a tree of `budget` nodes takes: 4 at the default batch whatever the budget, so
    `--budget auto` prices a smaller tree by its width, not by the forwards of a prefix of this one."""
    batch = options.get("batch") or math.ceil(budget / 4)
    return math.ceil(budget / batch)


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
) -> Tree:
    """`batch`: slots popped per draft forward (default budget / 4: 4 draft forwards a step, so the
    tree is at most 4 deep; batch=1 has no such cap but costs a draft forward per node).
    `select`: "sample" draws children without replacement from the draft (at `draft_temperature`
    when T = 0, at T otherwise), "top" takes them by draft probability, "auto" is "top" at T = 0
    and "sample" at T > 0.
    `score`: what estimates the chance of reaching a node: "draft", the product of draft
    probabilities on its path (the paper); "head", the product of SpecDec++ acceptance-head
    predictions (`head`: its file, else the one shipped for the pair). A node's prediction needs the
    draft's hidden state at it, so it exists once the node is forwarded and scores its descendants
    only: it never decides whether the node itself is kept, which keeps sampling exact.
    `auto_rates` (set by the engine under `--budget auto`): acceptance rates per slot bin
    (`dyspec.auto.budget.bin_rates`); with sampled children and score="draft", a slot is worth the
    chance of reaching its parent times its bin's rate, the value auto's cut will give its node.
    1 - mass prices a later sibling by the mass left, far above its chance (`budget.node_bins`), so
    the heap spent its pops on siblings the cut then dropped, and the main path stayed shallow. A
    slot's bin is known before its draw (q's sum of squares less the earlier siblings'), so this
    stays exact."""
    batch = math.ceil(budget / 4) if batch is None else batch
    if batch < 1:
        raise DyspecError(f"batch must be at least 1, got {batch}")
    sample, tau, sampling = child_mode(select, temperature, draft_temperature)
    acceptance_head = _head(score, head)
    learnt = auto_rates is not None and sample and acceptance_head is None
    tree = Tree.root(root, sampling)
    ranked: dict[int, tuple[list[int], list[float]]] = {}  # node -> its children candidates in order
    drawn: dict[int, tuple[int, float]] = {}  # node -> (children added so far, their q mass)
    reach: list[float] | dict[int, float] = {0: 1.0} if learnt else tree.values  # node -> chance of reaching it
    key_left: dict[int, float] = {}  # node -> sum of q^2 over the tokens its children have not taken
    if acceptance_head is not None:
        reach, predicted = {0: 1.0}, {}
        q1: dict[int, float] = {}  # node -> the draft's T = 1 probability of its token (the head's input)
        ranked_q1: dict[int, list[float]] = {}  # node -> T = 1 probabilities of its ranked candidates
    heap: list[tuple[float, int]] = []  # (-slot value, node)

    def slot_value(u: int) -> float:
        k, mass = drawn[u]
        if learnt:
            return slot_rate(auto_rates, key_left[u], later=k > 0)
        return 1 - mass if sample else ranked[u][1][k]

    def push_slot(u: int) -> None:
        k, _ = drawn[u]
        tokens, probs = ranked[u]
        if k < len(tokens) and probs[k] > 0:
            heapq.heappush(heap, (-reach[u] * slot_value(u), u))

    new = [0]
    while new and tree.size < budget:
        logits = draft.logits(tree, new)
        q = to_probs(logits, tau)
        tokens, probs = ranked_children(q, budget, sample, generator)
        if acceptance_head is not None:
            ranked_q1.update(zip(new, to_probs(logits, 1.0).gather(1, tokens).tolist()))
            if new != [0]:
                accept = acceptance_head.accept_prob(draft.hidden, torch.tensor([q1[n] for n in new]))
                for node, a in zip(new, accept.tolist()):
                    predicted[node] = a
                    reach[node] = reach[tree.parents[node]] * a
        squares = q.square().sum(-1).tolist() if learnt else None
        for i, node in enumerate(new):
            tree.q[node] = q[i]
            ranked[node] = (tokens[i].tolist(), probs[i].tolist())
            drawn[node] = (0, 0.0)
            if learnt:
                key_left[node] = squares[i]
            push_slot(node)
        new = []
        for _ in range(batch):
            if not heap or tree.size >= budget:
                break
            neg_value, u = heapq.heappop(heap)
            k, mass = drawn[u]
            child = tree.add(u, ranked[u][0][k], ranked[u][1][k])
            if acceptance_head is not None:
                q1[child] = ranked_q1[u][k]
            if learnt:
                reach[child] = -neg_value
                key_left[u] -= ranked[u][1][k] ** 2
            drawn[u] = (k + 1, mass + ranked[u][1][k])
            push_slot(u)
            if tree.depths[child] < max_depth:
                new.append(child)
        tree.end_expansion()
    if acceptance_head is not None:
        tree.extra = {"predicted_acceptance": [predicted.get(n) for n in range(1, len(tree))]}
    return tree


POLICY = Policy(
    "dyspec", build, needs_draft=True, prepare=prepare, auto_rates=True, grows_by_value=True, forwards_for=forwards_for
)
