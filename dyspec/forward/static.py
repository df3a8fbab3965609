"""The static-shape path (`--fast-path static` or `compiled`): the shapes CUDA graphs need.

Eager Hugging Face forwards over a cache that grows launch a kernel per op and reallocate the cache
every step; on a GPU a small model's forward is then bound by launches, not by reading its weights.
On this path each model keeps one KV cache, allocated once and written in place at a length kept on
the device (transformers' `StaticCache`), every forward runs at one of a few bucketed sizes (the
padding attends to itself alone and no token reads it), and its mask spans the whole cache: a
forward's shapes depend on its bucket alone. `compiled` compiles each bucket's forward up to the
largest tree once (`torch.compile`, mode "reduce-overhead": CUDA graphs on a GPU;
`StaticForward.session`); longer forwards (a prompt) run uncompiled over the same cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.utils.output_capturing import maybe_install_capturing_hooks

from dyspec.core.kv import KVSession, StaticModel
from dyspec.errors import DyspecError

ROUND = 1024  # capacities are multiples of it, so that later generations reuse a cache and its graphs


def compile_options(device: torch.device) -> dict:
    """How a bucket's forward is compiled: CUDA graphs on a GPU; whole graphs, one per shape, so that
    a graph break fails loudly instead of splitting the forward into launches again."""
    return {"mode": "reduce-overhead" if device.type == "cuda" else "default", "fullgraph": True, "dynamic": False}


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


@dataclass
class StaticForward:
    """A model on the static path: a preallocated cache per role, kept between generations so that a
    compiled forward is compiled once per bucket, not once per generation (so one model runs one
    generation at a time on this path); `compiled` runs each bucket's forward compiled."""

    model: PreTrainedModel
    compiled: bool
    held: dict[str, StaticModel] = field(default_factory=dict)

    def static_model(self, role: str, need: int) -> StaticModel:
        """The cache of `role` ("target", "draft0", ...: one model may be target and draft at once),
        emptied, holding at least `need` tokens."""
        s = self.held.get(role)
        if s is None or s.capacity < need:
            capacity = -(-need // ROUND) * ROUND
            s = self.held[role] = StaticModel(_new_cache(self.model, capacity), capacity, self._run())
        with torch.inference_mode():
            s.cache.reset()  # zeros, and the length on the device back to 0
        return s

    def _run(self):
        """The model, or its forward compiled (one graph per bucket, logits kept and role)."""
        if not self.compiled:
            return self.model
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)
        if isinstance(self.model, PreTrainedModel):  # installed lazily under a lock, which dynamo cannot trace
            maybe_install_capturing_hooks(self.model)
        return torch.compile(self.model, **compile_options(self.model.device))

    def session(self, role: str, need: int, sizes=(), last_only=(False, True), **kwargs) -> KVSession:
        """A session over the cache of `role`, with the forwards of `sizes` tokens compiled first."""
        kv = KVSession(self.model, static=self.static_model(role, need), **kwargs)
        if self.compiled:
            compile_forwards(kv, sizes, last_only)
        return kv


def compile_forwards(kv: KVSession, sizes, last_only: tuple[bool, ...]) -> None:
    """Compile (`--fast-path compiled`) the session's forwards of `sizes` tokens, returning all
    rows' logits or (`last_only`) the last one's, each with one forward of dummy tokens on its empty
    cache, behind a progress bar; other forwards run uncompiled over the same cache. Once per model,
    role and size: later generations reuse them."""
    jobs = [(size, last) for size in sizes for last in last_only if (size, last) not in kv.static.compiled]
    for size, last in tqdm(jobs, desc="compiling forwards (once per size)", disable=not jobs):
        if kv.cached:
            raise RuntimeError("forwards are compiled on an empty cache")
        kv.static.compiled.add((size, last))
        features = None
        if getattr(kv.model, "needs_features", False):  # the target's at a root, its own in a tree
            width = kv.model.feature_size if last else kv.model.config.hidden_size
            features = torch.zeros(size, width, dtype=kv.model.dtype, device=kv.device)
        kv.forward([0] * size, last_only=last, features=features)
        kv.forwards, kv.cached = 0, 0
        with torch.inference_mode():
            kv.cache.reset()
