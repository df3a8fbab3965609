"""The static-shape path (`--fast-path static` or `compiled`): the shapes CUDA graphs need.

Eager Hugging Face forwards over a cache that grows launch a kernel per op and reallocate the cache
every step; on a GPU a small model's forward is then bound by launches, not by reading its weights.
On this path each model keeps one KV cache, allocated once and written in place at a length kept on
the device (transformers' `StaticCache`), every forward runs at one of a few bucketed sizes (the
padding attends to itself alone and no token reads it), and its mask spans the whole cache: a
forward's shapes depend on its bucket alone. `compiled` compiles each bucket's forward up to the
largest tree once (`torch.compile`, mode "reduce-overhead": CUDA graphs on a GPU;
`dyspec.core.kv.compile_forwards`); longer forwards (a prompt) run uncompiled over the same cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.utils.output_capturing import maybe_install_capturing_hooks

from dyspec.errors import DyspecError

FAST_PATHS = ("off", "lean", "static", "compiled")  # "lean": dyspec.models.lean
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ROUND = 1024  # capacities are multiples of it, so that later generations reuse a cache and its graphs


def bucket(n: int) -> int:
    """The size a forward of n tokens runs at: the smallest bucket that holds it, else n itself."""
    return next((b for b in BUCKETS if b >= n), n)


def compile_options(device: torch.device) -> dict:
    """How a bucket's forward is compiled: CUDA graphs on a GPU; whole graphs, one per shape, so that
    a graph break fails loudly instead of splitting the forward into launches again."""
    return {"mode": "reduce-overhead" if device.type == "cuda" else "default", "fullgraph": True, "dynamic": False}


@dataclass
class StaticModel:
    """One model's preallocated cache for one role, and what runs its bucketed forwards."""

    cache: StaticCache
    capacity: int
    run: Callable  # the model, or its compiled forward
    compiled: set = field(default_factory=set)  # (size, last_only) of the forwards `run` serves


def _new_cache(model: PreTrainedModel, capacity: int) -> StaticCache:
    config = model.config
    cache = StaticCache(config=config, max_cache_len=capacity)
    if any(type(layer) is not StaticLayer for layer in cache.layers):
        raise DyspecError(
            f"the static path keeps full-attention layers only; {type(model).__name__} has sliding or "
            "chunked attention: use --fast-path off"
        )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    with torch.inference_mode():  # the cache is written in inference mode, so it must be an inference tensor
        cache.early_initialization(
            1, getattr(config, "num_key_value_heads", heads), head_dim, model.dtype, model.device
        )
    return cache


def static_model(model: PreTrainedModel, role: str, need: int, compiled: bool) -> StaticModel:
    """The model's static cache for `role` ("target", "draft0", ...: one model may be target and
    draft at once), emptied, holding at least `need` tokens. Kept on the model between generations,
    so that a compiled forward is compiled once per bucket, not once per generation; so one model
    runs one generation at a time on this path."""
    held = model.__dict__.setdefault("_dyspec_static", {})
    s = held.get(role)
    if s is None or s.capacity < need or compiled != (s.run is not model):
        capacity = -(-need // ROUND) * ROUND
        run = model
        if compiled:
            # one graph per bucket, logits kept (all or the last) and role: more than dynamo's default 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, 1024
            )
            if isinstance(model, PreTrainedModel):  # installed lazily under a lock, which dynamo cannot trace
                maybe_install_capturing_hooks(model)
            run = torch.compile(model, **compile_options(model.device))
        s = held[role] = StaticModel(_new_cache(model, capacity), capacity, run)
    with torch.inference_mode():
        s.cache.reset()  # zeros, and the length on the device back to 0
    return s
