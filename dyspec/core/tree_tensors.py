"""A step's token tree as tensors of fixed shape, for the step on the device (DESIGN.md, "The step on
the device"): a policy grows it in rounds of one draft forward, a top-k and a selection over the
candidates, with no host read; the target verifies it on the device; one host read copies
tree and verdict together (`read_step`), and the views' `Tree` is made from that copy.

Nodes are numbered in the order they were picked, rounds after one another, so a parent's id is
below its child's, as in `Tree`. A node may be padding (`valid` False): a pick past the budget or of
no candidate, kept so that every round adds the same number of nodes; it never has valid
descendants, never matches in verification, and is dropped from the `Tree`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from dyspec.core.kv import tree_mask
from dyspec.core.programs import program
from dyspec.core.sampling import residual
from dyspec.core.tree import Tree
from dyspec.core.vocab import DraftVocab, widen
from dyspec.kernels.row_stats import row_stats


@dataclass
class TreeTensors:
    tokens: torch.Tensor  # [N] int64 target token ids; node 0 the root
    parents: torch.Tensor  # [N] int64; the root is its own parent, so that gathers along paths stay in range
    depths: torch.Tensor  # [N] int64
    probs: torch.Tensor  # [N] float64: q(token) when drawn, as `Tree.draft_probs`
    values: torch.Tensor  # [N] float64: the product of probs on the root path, as `Tree.values`
    valid: torch.Tensor  # [N] bool
    ancestors: torch.Tensor  # [N, N] bool: (i, j) where j is i or an ancestor of i
    sampling: str
    vocab: DraftVocab | None
    # per draft forward: q and its node ids, a device tensor where the device chose them (read with the step);
    # where several drafts forward a node, the first one's row is the node's
    q: list[tuple[torch.Tensor, list[int] | torch.Tensor]] = field(default_factory=list)
    # node -> the row of `q` its token was drawn from, where not its parent's: another merged draft's q at the
    # root, a row of its own numbered past the tree's nodes
    drawn_from: dict[int, int] = field(default_factory=dict)
    growth: list[int] = field(default_factory=list)  # node count after each round, padding included
    # where the tree was cut on the device from a bigger one (`subtree`): each node's id in that one,
    # which `growth`, `q` and the draft's forwarded nodes speak of
    origin: torch.Tensor | None = None
    # the policy's own numbers per node for the views, as `Tree.extra` lists them: name -> [N] float64,
    # NaN where a node has none (None in the `Tree`)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)


def index_on(ids: list, device: torch.device) -> torch.Tensor:
    """`ids` (ints, or lists of them) as an index tensor on `device`, kept: a step asks for the same
    few each time, and a new one is a copy to the device."""
    return _index(_frozen(ids), device)


@functools.lru_cache(maxsize=1024)
def _index(ids: tuple, device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, device=device)


def _frozen(ids: list) -> tuple:
    return tuple(_frozen(i) if isinstance(i, list) else i for i in ids)


def new_tree(
    root: int, n: int, device: torch.device, sampling: str, vocab: DraftVocab | None, compiled: bool = False
) -> TreeTensors:
    """The root alone, with room for `n` nodes in all (`compiled`: its vectors made by one program;
    the ancestor matrix by `torch.eye`, since Inductor's CPU code fills a boolean matrix a hundred
    times slower)."""
    tokens, parents, depths, probs, values, valid = root_nodes(root, n, device, compiled=compiled)
    ancestors = torch.eye(n, dtype=torch.bool, device=device)
    return TreeTensors(tokens, parents, depths, probs, values, valid, ancestors, sampling, vocab)


@program
def root_nodes(root: int, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """`node_tensors` of the root alone but the ancestor matrix, with room for `n` nodes."""
    return (
        torch.full((n,), root, dtype=torch.long, device=device),
        torch.zeros(n, dtype=torch.long, device=device),
        torch.zeros(n, dtype=torch.long, device=device),
        torch.ones(n, dtype=torch.float64, device=device),
        torch.ones(n, dtype=torch.float64, device=device),
        torch.arange(n, device=device) == 0,
    )


def add_nodes(
    t: TreeTensors, start: int, parents: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor
) -> None:
    """Nodes start.. start + len(parents) - 1, children of `parents` (ids below start), in place."""
    place_nodes(node_tensors(t), start, parents, tokens, probs, valid)
    t.growth.append(start + len(parents))


def node_tensors(t: TreeTensors) -> tuple[torch.Tensor, ...]:
    """The tree's per-node tensors, as a compiled program takes them (`place_nodes`)."""
    return t.tokens, t.parents, t.depths, t.probs, t.values, t.valid, t.ancestors


def place_nodes(
    nodes: tuple[torch.Tensor, ...],
    start: int,
    parents: torch.Tensor,
    tokens: torch.Tensor,
    probs: torch.Tensor,
    valid: torch.Tensor,
) -> None:
    """`add_nodes` on the tree's `node_tensors`, in place."""
    t_tokens, t_parents, t_depths, t_probs, t_values, t_valid, t_ancestors = nodes
    new = slice(start, start + len(parents))
    t_parents[new], t_tokens[new], t_probs[new] = parents, tokens, probs
    t_depths[new] = t_depths[parents] + 1
    t_values[new] = t_values[parents] * probs
    t_valid[new] = valid & t_valid[parents]
    # the eye already holds each node itself; `where`, not `|=`: Inductor's CPU vector code for an in-place
    # bool OR of gathered rows does not compile (PyTorch 2.13)
    t_ancestors[new] = torch.where(t_ancestors[parents], True, t_ancestors[new])


@program
def target_inputs(
    tokens: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor, mask_at: tuple
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target forward's inputs (`KVSession.forward`): the tree's tokens and their positions after
    the committed tokens as one [2, N] tensor, and its mask (`tree_mask` at `mask_at`,
    `KVSession.tree_mask_at`), each node seeing its `ancestors`."""
    return torch.stack([tokens, mask_at[0] + depths]), tree_mask(ancestors, *mask_at)


def verify_greedy(t: TreeTensors, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`dyspec.core.verify.verify_greedy` on the device: the accepted nodes [N] bool (one root path)
    and the token after them. A node is taken where its token is the target's argmax after its
    parent and no earlier sibling's is (the walk tries children in id order), and so is every node
    on its path."""
    return greedy_accept(node_tensors(t), target_argmax)


def greedy_accept(nodes: tuple[torch.Tensor, ...], target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_greedy` on the tree's `node_tensors`."""
    tokens, parents, _, _, _, valid, ancestors = nodes
    ids = torch.arange(len(tokens), device=tokens.device)
    match = valid & (tokens == target_argmax[parents]) & (ids > 0)
    earlier = (parents[:, None] == parents[None, :]) & (ids[None, :] < ids[:, None]) & match[None, :]
    taken = (match & ~earlier.any(1)) | (ids == 0)
    accepted = ~(ancestors & ~taken[None, :]).any(1) & (ids > 0)
    end = (ids * accepted).amax(0, keepdim=True)  # ids grow along a path: its deepest node
    return accepted, target_argmax[end]  # indexed by a 1-d tensor: a 0-d one is read as an int


def greedy_verdict(
    logits: torch.Tensor, nodes: tuple[torch.Tensor, ...], compiled: bool = False
) -> tuple[torch.Tensor, ...]:
    """The target's greedy verdict on a tree from its `logits`: the accepted nodes, the token after
    them (`greedy_accept`), the target's probability of each node's token, and each row's
    logsumexp. The rows' argmax and logsumexp are `row_stats`'s (a CPU's kernel reads a row faster
    than compiled code does), the rest one program where `compiled`."""
    target_argmax, log_z = row_stats(logits)
    return *accept_greedily(logits, target_argmax, log_z, nodes, compiled=compiled), log_z


@program
def accept_greedily(
    logits: torch.Tensor, target_argmax: torch.Tensor, log_z: torch.Tensor, nodes: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """`greedy_accept`, and the target's probability of each node's token."""
    tokens, parents = nodes[0], nodes[1]
    return *greedy_accept(nodes, target_argmax), (logits[parents, tokens] - log_z[parents]).exp()


def proposals(t: TreeTensors, width: int, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, width] fp32: each forwarded node's draft distribution (the q its children were drawn from)
    over the target's `width` tokens, zero rows for nodes never forwarded, which have no children,
    then the rows of `drawn_from` past the nodes; and the sum of squares of each node's proposal
    (`Tree.agreement`) (`compiled`: by one program)."""
    device = t.tokens.device
    qs = [q for q, _ in t.q]
    at = [nodes if isinstance(nodes, torch.Tensor) else index_on(nodes, device) for _, nodes in t.q]
    ids = None if t.vocab is None else t.vocab.ids_on(device)
    rows = max([len(t), *(r + 1 for r in t.drawn_from.values())])
    return proposal_rows(qs, at, t.origin, rows, width, ids, drawn_rows(t), compiled=compiled)


def drawn_rows(t: TreeTensors) -> torch.Tensor:
    """[N] each node's row of `proposals`: its parent's, or the one `drawn_from` names."""
    if not t.drawn_from:
        return t.parents
    device = t.parents.device
    return t.parents.index_put((index_on(list(t.drawn_from), device),), index_on(list(t.drawn_from.values()), device))


@program
def proposal_rows(
    qs: list[torch.Tensor],
    at: list[torch.Tensor],
    origin: torch.Tensor | None,
    n: int,
    width: int,
    ids,
    drawn: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`proposals` from the forwards' q and node ids `at`, `n` rows, over a reduced vocabulary's
    `ids` (None: none), and each node's `drawn` row. In a cut tree (`origin`) a forward's ids are
    those before the cut: each row goes to its node's place, a node cut away to a spare row,
    dropped. Later forwards first: a node's row is the first forward's."""
    rows = torch.zeros(n + 1, width, device=qs[0].device)
    for q, nodes in reversed(list(zip(qs, at, strict=True))):
        if origin is not None:
            match = nodes[:, None] == origin[None, :]
            nodes = torch.where(match.any(1), match.int().argmax(1), n)
        rows[nodes] = widen(q, ids, width).float() if ids is not None else q.float()
    return rows[:-1], rows[:-1].square().sum(1)[drawn]


def verify_sampled(
    t: TreeTensors,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
    compiled: bool = False,
    visits: int = 8,
    Q: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`dyspec.core.verify.verify_sampled` on the device, with no host read: the accepted nodes [N]
    bool and the token after them. Nodes are visited in id order, which tries each node's children
    in drawing order and every child after its parent: one visit a node, in which it is tried when
    its parent is the node the walk stands on, with the walk's target distribution P and proposal
    D updated by masks (accept: move to the child; reject: the residual, and without replacement
    the token removed from D). The token after them is drawn from the last P (Exp(1) race). The
    visits run `visits` at a time, by one program each where `compiled`: one program for every
    tree size, its loop unrolled. `Q`: the tree's `proposals`, where the caller made them."""
    n = len(t)
    uniforms = torch.rand(n + p.shape[-1], generator=generator, device=p.device)  # each node's coin, the race's
    if Q is None and t.sampling != "deterministic":
        Q = proposals(t, p.shape[-1], compiled=compiled)[0]
    walk, nodes = None, (t.tokens, t.parents, t.valid, drawn_rows(t))
    for first in range(1, max(n, 2), visits):  # one call at least: it starts the walk
        walk = visit_nodes(walk, first, visits, nodes, p, Q, uniforms, t.sampling, compiled=compiled)
    return end_walk(walk, uniforms, compiled=compiled)


@program
def visit_nodes(
    walk: tuple | None,
    first: int,
    visits: int,
    nodes: tuple[torch.Tensor, ...],
    p: torch.Tensor,
    Q: torch.Tensor | None,
    uniforms: torch.Tensor,
    sampling: str,
) -> tuple:
    """`verify_sampled`'s visits of nodes first .. first + visits - 1 (those past the tree try
    nothing): the walk after them, from its start where `walk` is None. The walk: the node it
    stands on, P, D (without replacement: the proposal left after the tried children), whether D
    is used up (no more children tried), and each visit's verdict, with room for a last call's
    visits past the tree. A drawn child's proposal is its `drawn` row of Q, D without replacement;
    a chosen one's, one-hot on its token."""
    tokens, parents, valid, drawn = nodes
    n = len(tokens)
    unique = sampling == "without_replacement"
    if walk is None:
        zero = torch.zeros((), dtype=torch.long, device=p.device)
        verdicts = torch.zeros(n + visits, dtype=torch.bool, device=p.device)
        walk = zero, p[0], Q[0] if unique else None, zero.bool(), verdicts
    cur, P, D, stop, accepted = walk
    ids = torch.arange(first, first + visits, device=p.device)
    at = ids.clamp(max=n - 1)  # a visit past the tree reads the last node's row and tries nothing
    inside = valid[at] & (ids < n)
    x, u, coin, p_at = tokens[at], parents[at], uniforms[at], p[at]
    q_at = None if Q is None else Q[at] if unique else Q[drawn[at]]  # as parent (D's next) or as drawn
    taken = []
    for i in range(visits):
        xi = x[i : i + 1]  # 1-d: indexing with a 0-d tensor would read it on the host
        tried = inside[i] & (u[i] == cur) & ~stop
        proposal = D if unique else torch.zeros_like(P).scatter(0, xi, 1.0) if Q is None else q_at[i]
        take = (coin[i] * proposal[xi] <= P[xi])[0]
        rejected = residual(P, proposal)
        take, reject = tried & take, tried & ~take
        if unique:
            fewer = D.scatter(0, xi, 0.0)
            mass = fewer.sum()
            stop = torch.where(take, False, torch.where(reject, mass <= 0, stop))
            fewer = torch.where(mass > 0, fewer / mass, fewer)
            D = torch.where(take, q_at[i], torch.where(reject, fewer, D))
        P = torch.where(take, p_at[i], torch.where(reject, rejected, P))
        cur = torch.where(take, ids[i], cur)
        taken.append(take)
    accepted = accepted.clone()
    accepted[first : first + visits] = torch.stack(taken)
    return cur, P, D, stop, accepted


@program
def end_walk(walk: tuple, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_sampled`'s verdict from its walk: the accepted nodes, and the token after them drawn
    from the last P by an Exp(1) race on the uniforms after the nodes' coins."""
    P, accepted = walk[1], walk[4]
    n = len(uniforms) - len(P)
    return accepted[:n], (P / uniforms[n:].log().neg()).argmax(0, keepdim=True)


def subtree(t: TreeTensors, nodes: torch.Tensor, compiled: bool = False) -> TreeTensors:
    """The tree of the root and `nodes` (a device tensor of ids closed under ancestors: the valid ones
    ascending, any padding after them), renumbered on the device, as `Tree.subtree` does on the host
    (`compiled`: by one program)."""
    *cut, old = cut_nodes(node_tensors(t), nodes, compiled=compiled)
    return TreeTensors(
        *cut,
        sampling=t.sampling,
        vocab=t.vocab,
        q=t.q,
        growth=t.growth,
        origin=old,
        extra={name: v[old] for name, v in t.extra.items()},
    )


@program
def cut_nodes(nodes: tuple[torch.Tensor, ...], kept: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`node_tensors` of the root and the nodes `kept`, renumbered in that order, and their old ids."""
    tokens, parents, depths, probs, values, valid, ancestors = nodes
    old = torch.cat([kept.new_zeros(1), kept])
    new_id = torch.zeros(len(tokens), dtype=torch.long, device=old.device)
    new_id[old] = torch.arange(len(old), device=old.device)
    return (
        tokens[old],
        new_id[parents[old]],
        depths[old],
        probs[old],
        values[old],
        valid[old],
        ancestors[old][:, old],
        old,
    )


def read_step(
    t: TreeTensors,
    accepted: torch.Tensor,
    next_token: torch.Tensor,
    target_probs: torch.Tensor,
    compiled: bool = False,
    q_square: torch.Tensor | None = None,
    **extra,
) -> dict:
    """The tree, its verdict, the target's probability of each node's token, the tree's own `extra`,
    each node's `q_square` where given (`proposals`) and any `extra` 1-d tensors of ids here (None:
    left out), in one host read (float64 holds token ids exactly), packed by one program where
    `compiled`."""
    rows = {} if q_square is None else {"q_square": q_square}
    per_node = [t.tokens, t.parents, t.probs, t.valid, accepted, target_probs, *t.extra.values(), *rows.values()]
    extra = {k: [v] for k, v in extra.items() if v is not None}
    if t.origin is not None:
        extra["origin"] = [t.origin]
    if chosen := [nodes for _, nodes in t.q if isinstance(nodes, torch.Tensor)]:
        extra["q_nodes"] = chosen
    ids = [next_token, *(v for parts in extra.values() for v in parts)]
    table = packed(per_node, ids, compiled=compiled).tolist()
    n, names = len(t), ["tokens", "parents", "probs", "valid", "accepted", "target_probs", *t.extra, *rows]
    host = {name: table[i * n : (i + 1) * n] for i, name in enumerate(names)}
    at = len(names) * n
    host["next_token"] = int(table[at])
    at += 1
    for name, parts in extra.items():
        size = sum(len(v) for v in parts)
        host[name] = [int(x) for x in table[at : at + size]]
        at += size
    return host


@program
def rows_of(tensors: tuple[torch.Tensor | None, ...], rows: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Each tensor's `rows` (None stays None)."""
    return tuple(None if x is None else x[rows] for x in tensors)


@program
def packed(per_node: list[torch.Tensor], ids: list[torch.Tensor]) -> torch.Tensor:
    """`per_node` [N] tensors, then every 1-d tensor of `ids`, as one float64 table."""
    rows = torch.stack(per_node).to(torch.float64).flatten()
    return torch.cat([rows, *(v.reshape(-1).to(torch.float64) for v in ids)])


class Rows(Mapping):
    """Node -> its row of a forward's q, made when asked for: a view per node would be an op each."""

    def __init__(self, where: dict[int, tuple[torch.Tensor, int]]):
        self.where = where

    def __getitem__(self, node: int) -> torch.Tensor:
        q, i = self.where[node]
        return q[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def to_tree(t: TreeTensors, host: dict) -> tuple[Tree, list[int], list[int], list[float]]:
    """The views' `Tree` from `read_step`'s copy, padding dropped; the row of `t` of each of its
    nodes, its accepted node ids, and the target's probability of each node's token."""
    old_ids = [i for i, v in enumerate(host["valid"]) if v]
    new_id = {old: new for new, old in enumerate(old_ids)}
    tree = Tree.root(int(host["tokens"][0]), t.sampling, t.vocab)
    for old in old_ids[1:]:
        tree.add(new_id[int(host["parents"][old])], host["tokens"][old], host["probs"][old])
    first = [host["origin"][old] for old in old_ids] if "origin" in host else old_ids  # ids before any cut
    tree.growth = sorted({sum(1 for old in first if old < g) for g in t.growth})
    first_id = {old: new for new, old in enumerate(first)}
    chosen = iter(host.get("q_nodes", ()))  # the forwards' rows that the device chose, as read
    forwards = [
        (q, [next(chosen) for _ in range(len(nodes))] if isinstance(nodes, torch.Tensor) else nodes) for q, nodes in t.q
    ]
    # a row's place in the forwards, the first forward's where several drafts forwarded a node
    rows = {old: (q, i) for q, nodes in reversed(forwards) for i, old in enumerate(nodes)}
    tree.q = Rows({first_id[old]: row for old, row in rows.items() if old in first_id})  # type: ignore[assignment]
    tree.child_q = Rows({new_id[old]: rows[r] for old, r in t.drawn_from.items() if old in new_id})  # type: ignore[assignment]
    for name in t.extra:
        tree.extra[name] = [None if math.isnan(x) else x for x in (host[name][old] for old in old_ids[1:])]
    if "q_square" in host:  # a node's draws agree as often as its proposal with itself
        tree.agreement = {new_id[old]: host["q_square"][old] for old in old_ids[1:]}
    accepted = [new_id[i] for i, a in enumerate(host["accepted"]) if a]
    return tree, old_ids, accepted, [host["target_probs"][old] for old in old_ids]
