"""DySpec (Xiong et al. 2024), Alg. 1: a tree grown greedily by estimated acceptance.

A max-heap of sampling slots. A slot of node u yields u's next child (drawn without replacement
from q_u); its value is the chance of reaching that child's place, v_u * (1 - mass of the siblings
drawn before) when sampling, or the child's own value v_u * q_u[y] when taking the top-k. Popping
the best slot adds a node and pushes u's next-sibling slot; the new node's first-child slot needs
its draft distribution, so new nodes wait until the end of the round, when one draft forward
serves them all. A round pops up to `batch` slots; batch=1 is the paper's sequential algorithm.
"""

import heapq
import math

import torch

from dyspec.draft import DraftSession
from dyspec.errors import DyspecError
from dyspec.policies.common import child_mode
from dyspec.sampling import ranked_children, to_probs
from dyspec.tree import Tree

NEEDS_DRAFT = True


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
) -> Tree:
    """`batch`: slots popped per draft forward (default budget / 4: 4 draft forwards a step, so the
    tree is at most 4 deep; batch=1 has no such cap but costs a draft forward per node).
    `select`: "sample" draws children without replacement from the draft (at `draft_temperature`
    when T = 0, at T otherwise), "top" takes them by draft probability, "auto" is "top" at T = 0
    and "sample" at T > 0."""
    batch = math.ceil(budget / 4) if batch is None else batch
    if batch < 1:
        raise DyspecError(f"batch must be at least 1, got {batch}")
    sample, tau, sampling = child_mode(select, temperature, draft_temperature)
    tree = Tree.root(root, sampling)
    ranked: dict[int, tuple[list[int], list[float]]] = {}  # node -> its children candidates in order
    drawn: dict[int, tuple[int, float]] = {}  # node -> (children added so far, their q mass)
    heap: list[tuple[float, int]] = []  # (-slot value, node)

    def push_slot(u: int) -> None:
        k, mass = drawn[u]
        tokens, probs = ranked[u]
        if k < len(tokens) and probs[k] > 0:
            heapq.heappush(heap, (-tree.values[u] * (1 - mass if sample else probs[k]), u))

    new = [0]
    while new and tree.size < budget:
        q = to_probs(draft.logits(tree, new), tau)
        tokens, probs = ranked_children(q, budget, sample, generator)
        for i, node in enumerate(new):
            tree.q[node] = q[i]
            ranked[node] = (tokens[i].tolist(), probs[i].tolist())
            drawn[node] = (0, 0.0)
            push_slot(node)
        new = []
        for _ in range(batch):
            if not heap or tree.size >= budget:
                break
            _, u = heapq.heappop(heap)
            k, mass = drawn[u]
            child = tree.add(u, ranked[u][0][k], ranked[u][1][k])
            drawn[u] = (k + 1, mass + ranked[u][1][k])
            push_slot(u)
            if tree.depths[child] < max_depth:
                new.append(child)
        tree.end_expansion()
    return tree
