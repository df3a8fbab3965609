"""Autoregressive decoding: an empty tree, so each target forward commits exactly one token."""

import torch

from dyspec.core.contract import Policy
from dyspec.core.draft import DraftSession
from dyspec.core.tree import Tree


def build(draft: DraftSession, root: int, budget: int, temperature: float, generator: torch.Generator) -> Tree:
    return Tree.root(root)


POLICY = Policy(
    "ar",
    build,
    needs_draft=False,
    summary="plain decoding: one target forward a token, no draft; the baseline every speedup is measured against",
)
