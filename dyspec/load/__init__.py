"""Loading: a target and its drafts loaded together (pair.py: `load_pair`, `ModelPair`), drafts as
users name them (draft_spec.py), models and the device and precision they run at (loading.py),
and SpecDec++'s acceptance head for a pair (head.py)."""

from dyspec.load.draft_spec import DEFAULT_DRAFT, SHIPPED_DRAFTS, shipped_draft
from dyspec.load.loading import (
    DEFAULT_TARGET,
    PRECISIONS,
    default_gguf,
    load_model,
    pick_device,
)
from dyspec.load.pair import ModelPair, load_pair, pair_key

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "PRECISIONS",
    "SHIPPED_DRAFTS",
    "ModelPair",
    "default_gguf",
    "load_model",
    "load_pair",
    "pair_key",
    "pick_device",
    "shipped_draft",
]
