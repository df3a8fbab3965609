"""SGLang's EAGLE draft tree (`EagleWorker.draft` and `organize_draft_results` in
python/sglang/srt/speculative/): `steps` draft forwards; the first gives the root's top-`topk`
children, each later one the top-`topk` children of every node of the frontier, the `topk`
candidates with the best cumulative draft probability among them becoming the next frontier.
Every candidate of every step stays eligible, and the best `budget` of them by cumulative
probability (SGLang's `speculative_num_draft_tokens` - 1) are verified: their ancestors score
higher, so they form a tree. Children are chosen, not sampled, so at T > 0 they are verified as
one-hot proposals, which stays exact. `dyspec recommend --engine sglang` measures its settings.
EAGLE-2's own build (`dyspec.policies.eagle2`) is this one with EAGLE's defaults."""

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
    topk: int = 4,
    steps: int = 5,
    step: str = "host",
) -> Tree:
    """`step`: "device" grows it with `grow`."""
    on_device_asked(step)
    return expand_and_rerank(draft, root, budget, topk, steps)


def grow(
    draft: DraftSession, root: int, budget: int, temperature: float, generator: torch.Generator, options: dict
) -> TreeTensors:
    """`build`'s tree as tensor ops (`grow_and_rerank`)."""
    return grow_and_rerank(draft, root, budget, options["topk"], options["steps"])


POLICY = Policy(
    "sglang",
    build,
    grow=grow,
    on_device=asks_device,
    needs_draft=True,
    summary="SGLang's EAGLE tree: the top children of the best frontier nodes, the best nodes by path probability kept",
)
