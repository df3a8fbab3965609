"""Choices shared by the tree policies: where a step grows the tree, how children are chosen where a
node has several, EAGLE-style expansion and rerank."""

import torch

from dyspec.core.contract import slot_bins
from dyspec.core.draft import DraftSession
from dyspec.core.programs import program
from dyspec.core.sampling import ranked_children, to_probs, top_children
from dyspec.core.tree import Tree
from dyspec.core.tree_tensors import TreeTensors, index_on, new_tree, node_tensors, place_nodes, subtree
from dyspec.core.vocab import token_ids
from dyspec.errors import DyspecError

SELECTS = ("auto", "sample", "top")
STEPS = ("host", "device")


def on_device_asked(step: str) -> bool:
    """Whether a policy's `step` option asks for its tree grown on the device (its `grow`, where the
    policy's `on_device` allows it); the host, node by node, is the default (faster on a CPU:
    docs/results/cpu-device-step.md)."""
    if step not in STEPS:
        raise DyspecError(f"step must be one of {', '.join(STEPS)}, got '{step}'")
    return step == "device"


def asks_device(temperature: float, options: dict) -> bool:
    """A policy's `on_device` where its tensor program takes every option at every temperature."""
    return on_device_asked(options["step"])


def child_mode(select: str, temperature: float, draft_temperature: float) -> tuple[bool, float, str]:
    """(sample children?, temperature of the draft distribution, how the tree's children were drawn).

    Sampled children are drawn without replacement from the draft at the target's temperature, or at
    `draft_temperature` when decoding greedily. "top" children are chosen, not drawn, so they are
    verified as deterministic proposals; their draft probabilities at the same temperature rank and
    value them (at T = 0, the sharper draft_temperature values build deeper trees, which measured
    better than T = 1 values with the int8 draft: 4.34 vs 3.94 tokens per forward at budget 8).
    """
    if select not in SELECTS:
        raise DyspecError(f"select must be one of {', '.join(SELECTS)}, got '{select}'")
    if draft_temperature <= 0:
        raise DyspecError(f"draft_temperature must be > 0, got {draft_temperature}")
    sample = select == "sample" or (select == "auto" and temperature > 0)
    tau = temperature if temperature > 0 else draft_temperature
    return sample, tau, "without_replacement" if sample else "deterministic"


def drawn_slot(probs: list[float], k: int, sample: bool) -> float:
    """The paper's value of node u's k-th child slot relative to u: when sampling without
    replacement, the q mass its earlier siblings left (1 - q(y_1) - ... - q(y_k-1)); when taking
    the top k, the child's own q(y_k)."""
    return 1 - sum(probs[:k]) if sample else probs[k]


def drawn_slots(p: torch.Tensor, sample: bool) -> torch.Tensor:
    """`drawn_slot` of every child slot [rows, k] of rows of candidates' probabilities `p` in drawing
    order, the earlier siblings' mass summed left to right as the host's `sum` does."""
    return 1 - torch.nn.functional.pad(p.cumsum(1)[:, :-1], (1, 0)) if sample else p


def learnt_scores(rates: list[float] | None, n: int, device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """What a tree grown on the device values drawn slots by under `--budget auto` (`auto_rates`, None
    without): the learnt rates per bin on `device`, and each of the `n` nodes' chance of being
    reached, which a node takes from its slot (`learnt_worth`)."""
    if rates is None:
        return None
    return torch.tensor(rates, dtype=torch.float64, device=device), torch.ones(n, dtype=torch.float64, device=device)


def learnt_worth(q: torch.Tensor, p: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
    """Under `--budget auto` with drawn children, the worth of each child slot [rows, k] of the nodes
    whose draft distributions are `q`, their candidates' probabilities `p` in drawing order: the
    rate auto learnt (`rates`, per bin) for the key the slot's earlier siblings left, q's sum of
    squares less their q^2, subtracted one by one as the host's builds do (`slot_rate`)."""
    keys = torch.cat([q.square().sum(-1, keepdim=True).double(), -p[:, :-1].square()], 1).cumsum(1)
    return rates[slot_bins(keys, torch.arange(p.shape[1], device=p.device) > 0)]


def expand_and_rerank(draft: DraftSession, root: int, budget: int, topk: int, steps: int) -> Tree:
    """EAGLE-2's and SGLang's build: `steps` draft forwards, the first over the root, each later one
    over the `topk` candidates of the forward before with the highest value (cumulative draft
    probability at T = 1, ties to the older node); each forwarded node gets its `topk` most
    probable children as candidates, and every candidate stays in the tree until the rerank keeps
    the `budget` best of them all."""
    tree = Tree.root(root, "deterministic", draft.vocab)
    frontier = [0]
    for _ in range(steps):
        q = to_probs(draft.logits(tree, frontier), 1.0)
        columns, probs = ranked_children(q, topk, sample=False)
        tokens, rows = tree.candidates(columns, probs, q.shape[-1])  # one host read for the round
        added = [tree.add(u, y, p) for i, u in enumerate(frontier) for y, p in zip(tokens[i], rows[i])]
        tree.end_expansion()
        frontier = sorted(added, key=lambda n: (-tree.values[n], n))[:topk]
    return rerank(tree, draft, budget)


def grow_and_rerank(draft: DraftSession, root: int, budget: int, topk: int, steps: int) -> TreeTensors:
    """`expand_and_rerank` as tensor ops with no host read: each forward's frontier is chosen on the
    device (the top `topk` of the round's candidates by value, ties to the older node, as a stable
    sort orders them), and the rerank's `budget` best nodes are cut out of the pool there (`subtree`).
    Its children are chosen, not drawn, at every temperature."""
    device = draft.kv.device
    t = new_tree(root, 1 + topk + (steps - 1) * topk * topk, device, "deterministic", draft.vocab, draft.compiled)
    vocab = draft.vocab_columns(device)
    logits = draft.logits(Tree.root(root, "deterministic", draft.vocab), [0], on_device=True)
    frontier, start = index_on([0], device), 1
    for r in range(steps):
        frontier = expand_round(logits, node_tensors(t), frontier, start, topk, *vocab, compiled=draft.compiled)
        start += len(logits) * topk
        t.growth.append(start)
        if r + 1 < steps:
            logits = draft.tree_logits(t, frontier)
    return subtree(t, best_nodes(t.values, budget, compiled=draft.compiled), compiled=draft.compiled)


@program
def expand_round(
    logits: torch.Tensor,
    nodes: tuple[torch.Tensor, ...],
    frontier: torch.Tensor,
    start: int,
    topk: int,
    vocab_ids: torch.Tensor | None,
    vocab_size: int,
) -> torch.Tensor:
    """A round of `grow_and_rerank`, one program: the `topk` most probable children (at T = 1) of
    each forwarded node of `frontier` added as nodes start.., and the next frontier (returned)."""
    columns, probs = top_children(to_probs(logits, 1.0), topk, None)
    tokens = token_ids(columns, logits.shape[-1], vocab_ids, vocab_size)
    n = columns.numel()
    valid = torch.ones(n, dtype=torch.bool, device=logits.device)
    place_nodes(
        nodes, start, frontier.repeat_interleave(columns.shape[1]), tokens.flatten(), probs.flatten().double(), valid
    )
    return start + nodes[4][start : start + n].sort(descending=True, stable=True).indices[:topk]


@program
def best_nodes(values: torch.Tensor, budget: int) -> torch.Tensor:
    """The rerank's `budget` nodes of highest value but the root, ties to the older node, ascending."""
    return (1 + values[1:].sort(descending=True, stable=True).indices[:budget]).sort().values


def rerank(tree: Tree, draft: DraftSession, budget: int) -> Tree:
    """The `budget` nodes of highest value (cumulative draft probability), as EAGLE-2 and SGLang
    verify them after expanding: values only shrink along a path, and ties go to the older node, so
    the kept nodes always include their ancestors."""
    keep = sorted(sorted(range(1, len(tree)), key=lambda n: (-tree.values[n], n))[:budget])
    pruned, old_ids = tree.subtree(keep)
    draft.relabel(old_ids)
    return pruned
