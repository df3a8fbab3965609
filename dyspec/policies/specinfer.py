"""SpecInfer (Miao et al. 2023): a static k-ary tree, `expansion` children per node at each depth,
drawn i.i.d. from the draft and verified by multi-step speculative sampling. At T = 0 the children
are the top-k draft tokens instead (i.i.d. draws from a one-hot q would all be the same token).
With several drafts, each grows its own such tree and the trees share one target forward."""

import math

import torch

from dyspec.core.contract import AutoNeeds, Policy
from dyspec.core.draft import DraftSession
from dyspec.core.programs import program
from dyspec.core.sampling import inverse_cdf, ranked_children, sample_rows, to_probs, top_children
from dyspec.core.tree import Tree
from dyspec.core.tree_tensors import TreeTensors, index_on, new_tree, node_tensors, place_nodes
from dyspec.core.vocab import token_ids, widen
from dyspec.errors import DyspecError
from dyspec.policies.common import asks_device, on_device_asked


def expansion_widths(expansion: str | list[int]) -> list[int]:
    """Children per node at each depth, from "2,2,1" or [2, 2, 1]."""
    try:
        widths = [int(w) for w in (expansion.split(",") if isinstance(expansion, str) else expansion)]
    except ValueError:
        raise DyspecError(f"expansion must be children per depth like 2,2,1; got '{expansion}'") from None
    if not widths or min(widths) < 1:
        raise DyspecError(f"expansion must be positive children counts like 2,2,1; got '{expansion}'")
    return widths


def prepare(pair, temperature: float, options: dict) -> dict:
    """The expansion checked before any model runs (a first generation may compile for a minute)."""
    if options.get("expansion") is not None:
        expansion_widths(options["expansion"])
    return options


def merged_drafts(drafts: list[DraftSession], n_drafts: int | None, budget: int) -> int:
    """How many of the loaded `drafts` grow a tree (`n_drafts`; default: all), checked."""
    k = len(drafts) if n_drafts is None else n_drafts
    if not 1 <= k <= len(drafts):
        raise DyspecError(f"n_drafts must be between 1 and the {len(drafts)} drafts loaded, got {n_drafts}")
    if budget < k:
        raise DyspecError(f"a budget of {budget} cannot hold a tree from each of {k} drafts")
    return k


def parse_expansion(expansion: str | list[int] | None, budget: int) -> list[int]:
    """Children per node at each depth, e.g. "2,2,1". The default is 2 at the root, then chains,
    as many levels as the budget allows."""
    if expansion is None:
        return [min(2, budget)] + [1] * (budget // 2 - 1)
    widths = expansion_widths(expansion)
    size, level = 0, 1
    for w in widths:
        level *= w
        size += level
    if size > budget:
        raise DyspecError(
            f"expansion {','.join(map(str, widths))} makes a tree of {size} nodes, over the budget {budget}"
        )
    return widths


def build(
    drafts: list[DraftSession],
    root: int,
    budget: int,
    temperature: float,
    generator: torch.Generator,
    *,
    expansion: str | None = None,
    n_drafts: int | None = None,
    step: str = "host",
) -> Tree:
    """`drafts`: every draft loaded (the engine passes them all, since the policy is multi_draft); the first
    `n_drafts` (default: all) each grow the expansion's tree, in one shared token tree. `step`:
    "device" grows it with `grow`."""
    on_device_asked(step)
    k = merged_drafts(drafts, n_drafts, budget)
    widths = parse_expansion(expansion, budget // k)
    # merged drafts' q's span the target's whole vocabulary, so that a tree has one set of columns
    vocab = drafts[0].vocab if k == 1 else None
    tree = Tree.root(root, "iid" if temperature > 0 else "deterministic", vocab)
    frontiers = [[0] for _ in range(k)]  # per draft: the nodes it grows next
    for width in widths:
        for d, draft in enumerate(drafts[:k]):
            frontiers[d] = _expand(tree, draft, d, frontiers[d], width, temperature, generator)
        tree.end_expansion()
    return tree


def _expand(
    tree: Tree, draft: DraftSession, d: int, frontier: list[int], width: int, temperature: float, generator
) -> list[int]:
    """Draft d gives each frontier node `width` children; returns them. At T = 0 (top-k children) a
    token another draft already put there is shared, not repeated: the drafts' trees merge. At
    T > 0 each draw stays its own node and is verified against the q of the draft that drew it."""
    q = to_probs(draft.logits(tree, frontier), temperature if temperature > 0 else 1.0)
    if tree.vocab is None and draft.vocab is not None:
        q = draft.vocab.widen(q)
    if temperature > 0:
        columns = sample_rows(q, width, generator)
    else:
        columns = ranked_children(q, width, sample=False)[0]
    tokens, probs = tree.candidates(columns, q.gather(-1, columns), q.shape[-1])  # one host read for the layer
    children = []
    for i, u in enumerate(frontier):
        if d == 0:
            tree.q[u] = q[i]
        for y, q_y in zip(tokens[i], probs[i]):
            shared = next((c for c in tree.children(u) if tree.tokens[c] == y), None) if temperature == 0 else None
            if shared is None:
                shared = tree.add(u, y, q_y)
                if d > 0:
                    tree.child_q[shared] = q[i]
            children.append(shared)
    return children


def grow(
    drafts: list[DraftSession],
    root: int,
    budget: int,
    temperature: float,
    generator: torch.Generator,
    options: dict,
) -> TreeTensors:
    """`build`'s tree as tensor ops with no host read: the shape is static, so each layer is every
    frontier node of each draft forwarded together, and each node's children are the next ids,
    drawn (or at T = 0 chosen) from its row as `_expand` draws them, draft after draft. At T = 0 a
    child whose token an earlier draft already put under its parent is padding, and the earlier
    node grows on in its place: the drafts' trees merge as `_expand`'s do. The root's children from
    another draft than the first are drawn from its own q at the root, a row of `q` past the tree
    (`drawn_from`)."""
    k = merged_drafts(drafts, options["n_drafts"], budget)
    drafts = drafts[:k]
    widths = parse_expansion(options["expansion"], budget // k)
    sampling, device, compiled = "iid" if temperature > 0 else "deterministic", drafts[0].kv.device, drafts[0].compiled
    size = 1 + k * sum(math.prod(widths[: i + 1]) for i in range(len(widths)))
    # merged drafts' q's span the target's whole vocabulary, as `build`'s do
    t = new_tree(root, size, device, sampling, drafts[0].vocab if k == 1 else None, compiled=compiled)
    logits = [draft.logits(Tree.root(root, sampling, draft.vocab), [0], on_device=True) for draft in drafts]
    frontiers: list[list[int] | torch.Tensor] = [[0]] * k  # a device tensor where drafts shared nodes
    start = 1
    for layer, width in enumerate(widths):
        layer_start = start
        for d, draft in enumerate(drafts):
            frontier = frontiers[d]
            rows = frontier if isinstance(frontier, torch.Tensor) else index_on(frontier, device)
            # the draws' uniforms (`sample_rows`' stream) drawn outside the program, which takes no generator
            shape = (len(frontier), width)
            u = torch.rand(shape, dtype=torch.float64, generator=generator, device=device) if temperature > 0 else None
            shared_from = layer_start if temperature == 0 else start  # drawn children are never shared
            at, vocab = (start, shared_from, width), (*draft.vocab_columns(device), k > 1)
            q, children = kary_layer(logits[d], temperature, u, node_tensors(t), rows, at, *vocab, compiled=compiled)
            stop = start + len(frontier) * width
            if layer == 0 and d > 0:  # its own q at the root, in a row of its own
                t.q.append((q, [size + d - 1]))
                t.drawn_from.update(dict.fromkeys(range(start, stop), size + d - 1))
            else:
                t.q.append((q, frontier))
            frontiers[d] = children if shared_from < start else list(range(start, stop))
            start = stop
        t.growth.append(start)
        if layer + 1 < len(widths):
            logits = [draft.tree_logits(t, frontier) for draft, frontier in zip(drafts, frontiers, strict=True)]
    return t


@program
def kary_layer(
    logits: torch.Tensor,
    temperature: float,
    u: torch.Tensor | None,
    nodes: tuple[torch.Tensor, ...],
    frontier: torch.Tensor,
    at: tuple[int, int, int],
    vocab_ids: torch.Tensor | None,
    vocab_size: int,
    wide: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer of one draft's static k-ary tree, one program: each node of `frontier`, forwarded as
    `logits`, gets `width` children drawn from the draft's q at `temperature` at the uniforms `u`
    [n, width] (`sample_rows`' inverse CDF) or, where None, its top ones at T = 1, placed as nodes
    start.. in order (`at`: start, shared_from, width); q spans the target's vocabulary where `wide`
    (merged drafts). A child whose parent has its token among nodes shared_from .. start - 1
    already is padding, and that node stands for it. Returns q and the children's ids so."""
    start, shared_from, width = at
    q = to_probs(logits, temperature if temperature > 0 else 1.0)
    if wide and vocab_ids is not None:
        q, vocab_ids = widen(q, vocab_ids, vocab_size), None
    columns = top_children(q, width, None)[0] if u is None else inverse_cdf(q, u)
    tokens = token_ids(columns, q.shape[-1], vocab_ids, vocab_size).flatten()
    parents = frontier.repeat_interleave(width)
    ids = torch.arange(start, start + len(parents), device=q.device)
    unshared = torch.ones(len(parents), dtype=torch.bool, device=q.device)
    if shared_from < start:
        earlier = slice(shared_from, start)
        same = (nodes[1][earlier] == parents[:, None]) & (nodes[0][earlier] == tokens[:, None]) & nodes[5][earlier]
        unshared = ~same.any(1)
        ids = torch.where(unshared, ids, shared_from + same.int().argmax(1))
    place_nodes(nodes, start, parents, tokens, q.gather(-1, columns).flatten().double(), unshared)
    return q, ids


POLICY = Policy(
    "specinfer",
    build,
    grow=grow,
    on_device=asks_device,
    needs_draft=True,
    multi_draft=True,
    prepare=prepare,
    auto=AutoNeeds(shape_options=("expansion",)),
    summary="SpecInfer: a static tree, the same number of children at every depth, fixed in advance",
)
