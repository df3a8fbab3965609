"""Models: a target and its drafts loaded together (pair.py: `load_pair`, `ModelPair`), drafts as
users name them (draft_spec.py), loading and the device, precision and forward they run at
(loading.py), the cache folder (cache.py), int8 layers (quant.py), the lean forward (lean.py),
which forward and cache run a model (fastpath.py), the feature draft and SpecDec++'s head."""

from dyspec.models.draft_spec import DEFAULT_DRAFT, SHIPPED_DRAFTS, shipped_draft
from dyspec.models.loading import (
    DEFAULT_TARGET,
    PRECISIONS,
    check_lean,
    default_gguf,
    load_model,
    pick_device,
)
from dyspec.models.pair import ModelPair, load_pair, pair_key

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "PRECISIONS",
    "SHIPPED_DRAFTS",
    "ModelPair",
    "check_lean",
    "default_gguf",
    "load_model",
    "load_pair",
    "pair_key",
    "pick_device",
    "shipped_draft",
]
