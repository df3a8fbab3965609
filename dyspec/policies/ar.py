"""Autoregressive decoding: an empty tree, so each target forward commits exactly one token."""

import torch

from dyspec.draft import DraftSession
from dyspec.tree import Tree

NEEDS_DRAFT = False


def build(draft: DraftSession, root: int, budget: int, temperature: float, generator: torch.Generator) -> Tree:
    return Tree.root(root)
