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
from dyspec.core.tree_tensors import TreeTensors, new_tree, node_tensors, place_nodes
from dyspec.core.vocab import token_ids
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
    """The expansion checked before any model runs (a first generation may compile for a minute), and
    that a step on the device has one draft to grow."""
    if options.get("expansion") is not None:
        expansion_widths(options["expansion"])
    merged = options.get("n_drafts") or 1 + len(pair.extra_drafts)
    if on_device_asked(options.get("step", "host")) and merged > 1:
        raise DyspecError(
            f"step=device grows one draft's tree; {merged} merged drafts build on the host "
            "(step=host, or n_drafts=1 for the first draft alone)"
        )
    return options


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
    "device" grows one draft's tree with `grow`."""
    on_device_asked(step)
    k = len(drafts) if n_drafts is None else n_drafts
    if not 1 <= k <= len(drafts):
        raise DyspecError(f"n_drafts must be between 1 and the {len(drafts)} drafts loaded, got {n_drafts}")
    if budget < k:
        raise DyspecError(f"a budget of {budget} cannot hold a tree from each of {k} drafts")
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
    draft: DraftSession, root: int, budget: int, temperature: float, generator: torch.Generator, options: dict
) -> TreeTensors:
    """`build`'s tree from one draft as tensor ops with no host read: the shape is static, so each
    layer is every node of the one before forwarded together, and each node's children are the next
    ids, drawn (or at T = 0 chosen) from its row as `_expand` draws them."""
    widths = parse_expansion(options["expansion"], budget)
    sampling, device = "iid" if temperature > 0 else "deterministic", draft.kv.device
    size = 1 + sum(math.prod(widths[: i + 1]) for i in range(len(widths)))
    t = new_tree(root, size, device, sampling, draft.vocab, compiled=draft.compiled)
    vocab = draft.vocab_columns(device)
    logits = draft.logits(Tree.root(root, sampling, draft.vocab), [0], on_device=True)
    frontier = range(1)
    for layer, width in enumerate(widths):
        # the draws' uniforms (`sample_rows`' stream) drawn outside the program, which takes no generator
        shape = (len(frontier), width)
        u = torch.rand(shape, dtype=torch.float64, generator=generator, device=device) if temperature > 0 else None
        layer_at = (frontier.start, frontier.stop, width)
        q = kary_layer(logits, temperature, u, node_tensors(t), layer_at, *vocab, compiled=draft.compiled)
        t.q.append((q, list(frontier)))
        t.growth.append(frontier.stop + len(frontier) * width)
        frontier = range(frontier.stop, frontier.stop + len(frontier) * width)
        if layer + 1 < len(widths):
            logits = draft.tree_logits(t, list(frontier))
    return t


@program
def kary_layer(
    logits: torch.Tensor,
    temperature: float,
    u: torch.Tensor | None,
    nodes: tuple[torch.Tensor, ...],
    layer: tuple[int, int, int],
    vocab_ids: torch.Tensor | None,
    vocab_size: int,
) -> torch.Tensor:
    """A layer of the static k-ary tree, one program: each node first.. stop - 1 (`layer`: first,
    stop, width), forwarded as `logits`, gets `width` children drawn from the draft's q at
    `temperature` at the uniforms `u` [n, width] (`sample_rows`' inverse CDF) or, where None, its
    top ones at T = 1, placed as the next ids in order. Returns q."""
    first, stop, width = layer
    q = to_probs(logits, temperature if temperature > 0 else 1.0)
    columns = top_children(q, width, None)[0] if u is None else inverse_cdf(q, u)
    tokens = token_ids(columns, q.shape[-1], vocab_ids, vocab_size)
    parents = torch.arange(first, stop, device=q.device).repeat_interleave(columns.shape[1])
    every = torch.ones(columns.numel(), dtype=torch.bool, device=q.device)
    place_nodes(nodes, stop, parents, tokens.flatten(), q.gather(-1, columns).flatten().double(), every)
    return q


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
