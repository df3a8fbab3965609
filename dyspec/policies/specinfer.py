"""SpecInfer (Miao et al. 2023): a static k-ary tree, `expansion` children per node at each depth,
drawn i.i.d. from the draft and verified by multi-step speculative sampling. At T = 0 the children
are the top-k draft tokens instead (i.i.d. draws from a one-hot q would all be the same token)."""

import torch

from dyspec.draft import DraftSession
from dyspec.errors import DyspecError
from dyspec.sampling import ranked_children, to_probs
from dyspec.tree import Tree

NEEDS_DRAFT = True


def parse_expansion(expansion: str | list[int] | None, budget: int) -> list[int]:
    """Children per node at each depth, e.g. "2,2,1". The default is 2 at the root, then chains,
    as many levels as the budget allows."""
    if expansion is None:
        return [min(2, budget)] + [1] * (budget // 2 - 1)
    try:
        widths = [int(w) for w in (expansion.split(",") if isinstance(expansion, str) else expansion)]
    except ValueError:
        raise DyspecError(f"expansion must be children per depth like 2,2,1; got '{expansion}'") from None
    if not widths or min(widths) < 1:
        raise DyspecError(f"expansion must be positive children counts like 2,2,1; got '{expansion}'")
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
    draft: DraftSession,
    root: int,
    budget: int,
    temperature: float,
    generator: torch.Generator,
    *,
    expansion: str | None = None,
) -> Tree:
    widths = parse_expansion(expansion, budget)
    tree = Tree.root(root, "iid" if temperature > 0 else "deterministic")
    frontier = [0]
    for width in widths:
        q = to_probs(draft.logits(tree, frontier), temperature if temperature > 0 else 1.0)
        if temperature > 0:
            tokens = torch.multinomial(q, width, replacement=True, generator=generator)
        else:
            tokens = ranked_children(q, width, sample=False)[0]
        next_frontier = []
        for i, u in enumerate(frontier):
            tree.q[u] = q[i]
            next_frontier += [tree.add(u, y, float(q[i, y])) for y in tokens[i].tolist()]
        tree.end_expansion()
        frontier = next_frontier
    return tree
