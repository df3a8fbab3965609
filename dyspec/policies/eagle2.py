"""EAGLE-2's dynamic draft tree (Li et al. 2024), as SafeAILab/EAGLE builds it
(`Model.topK_genrate` in eagle/model/cnets.py): the root's top-`topk` children, then `depth`
rounds in which each of the `topk` best candidates of the round before (by cumulative draft
probability) gets its top-`topk` children; every candidate of every round stays eligible
(`topk + depth * topk^2` in all), and the best `budget` of them are verified (EAGLE's
`total_token` - 1). Defaults are EAGLE's `EaModel` (total_token 60: budget 59, depth 7, top_k 10;
its draft `Model` alone defaults to depth 5, top_k 8). Children are chosen, not sampled, so at
T > 0 they are verified as one-hot proposals, which stays exact.

The build is SGLang's (`dyspec.policies.sglang`, the same pool and rerank, with `steps` = depth + 1
draft forwards); the two differ in their defaults, and EAGLE ranks by summed log-probabilities
where SGLang and dyspec multiply probabilities (the same order but at floating-point ties)."""

import torch

from dyspec.core.contract import Policy
from dyspec.core.draft import DraftSession
from dyspec.core.tree import Tree
from dyspec.core.tree_tensors import TreeTensors
from dyspec.policies.common import asks_device, expand_and_rerank, grow_and_rerank, on_device_asked


def build(
    draft: DraftSession,
    root: int,
    budget: int,
    temperature: float,
    generator: torch.Generator,
    *,
    topk: int = 10,
    depth: int = 7,
    step: str = "host",
) -> Tree:
    """`step`: "device" grows it with `grow`."""
    on_device_asked(step)
    return expand_and_rerank(draft, root, budget, topk, depth + 1)


def grow(
    draft: DraftSession, root: int, budget: int, temperature: float, generator: torch.Generator, options: dict
) -> TreeTensors:
    """`build`'s tree as tensor ops (`grow_and_rerank`)."""
    return grow_and_rerank(draft, root, budget, options["topk"], options["depth"] + 1)


POLICY = Policy(
    "eagle2",
    build,
    grow=grow,
    on_device=asks_device,
    needs_draft=True,
    summary="EAGLE-2: expands the likeliest paths for a few rounds, then keeps the budget's best nodes",
)
