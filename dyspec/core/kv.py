"""One model and its KV cache, with forwards over token trees and commits of an accepted path."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import DynamicCache, PreTrainedModel

from dyspec.core.draft_model import FINAL, draft_model
from dyspec.core.programs import program
from dyspec.errors import DyspecError
from dyspec.kernels.row_attention import keep_slots

# what each model call runs inside: dyspec.eval.anatomy sets it to leave the models' own ops out of its counts
MODEL_CALL: ContextVar[Callable[[], AbstractContextManager]] = ContextVar("model_call", default=nullcontext)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the sizes a static forward runs at (dyspec.forward.static)


class Output(NamedTuple):
    """What dyspec's own forwards return, read as KVSession reads a Hugging Face causal LM's output:
    a plain tuple, where a transformers ModelOutput costs microseconds to build, several a step."""

    logits: torch.Tensor
    hidden_states: Sequence[torch.Tensor] | None = None


def bucket(n: int) -> int:
    """The size a forward of n tokens runs at: the smallest bucket that holds it, else n itself."""
    return next((b for b in BUCKETS if b >= n), n)


@dataclass
class StaticModel:
    """One model's preallocated cache for one role (dyspec.forward.static), and what runs its bucketed
    forwards."""

    cache: object  # transformers' StaticCache
    capacity: int
    run: Callable  # the model, or its compiled forward
    compiled: set = field(default_factory=set)  # (size, last_only) of the forwards `run` serves


def target_features(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...] = FINAL) -> torch.Tensor:
    """What a feature draft reads from a target forward run with `output_hidden_states=True`: the
    hidden states at `layers` (indices into `hidden_states`; -1, the final one after the final
    norm, last), concatenated on the last axis (the final one alone as it is)."""
    return hidden_states[layers[0]] if len(layers) == 1 else torch.cat([hidden_states[i] for i in layers], dim=-1)


def cache_kwarg(forward: Callable) -> str:
    """The name a forward takes its KV cache by: `cache` since transformers 5.24 (`past_key_values`
    still works there, with a FutureWarning on stderr), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that wall-clock timings measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class NoCache:
    """The cache of a model that attends to nothing (`cacheless`: dyspec.drafts.medusa): KVSession
    keeps its lengths, and there are no keys to move."""

    layers = ()

    def crop(self, tokens_to_remove: int) -> None:
        pass

    def reset(self) -> None:
        pass


@program
def tree_mask(
    visible: torch.Tensor, length: int, start: int, size: int, width: int, bool_mask: bool, dtype: torch.dtype
) -> torch.Tensor:
    """The mask [1, 1, size, width] of a tree's forward of n tokens at slots start.. (`visible` [n,
    start - length + n] over the uncommitted slots and themselves) padded to `size`: its rows see
    the `length` committed slots and then `visible`, each padding row itself alone; boolean with
    `bool_mask`, else additive in `dtype`."""
    n, pad = len(visible), size - len(visible)
    rows = torch.cat([visible.new_ones(n, length), visible, visible.new_zeros(n, width - start - n)], 1)
    padding = torch.eye(pad, width - start - n, dtype=torch.bool, device=visible.device)
    see = torch.cat([rows, torch.cat([visible.new_zeros(pad, start + n), padding], 1)])
    if bool_mask:
        return see[None, None]
    return torch.zeros(see.shape, dtype=dtype, device=see.device).masked_fill_(~see, torch.finfo(dtype).min)[None, None]


@program
def copied_out(
    logits: torch.Tensor, features: tuple[torch.Tensor, ...] | None, n: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A replayed forward's first n rows copied out of its outputs, which its next replay overwrites:
    the logits in float32 and the `features` (each hidden state a feature draft reads, as
    `target_features` concatenates them; None: none kept)."""
    hidden = None if features is None else torch.cat(features, dim=-1)[0, :n].clone()
    return logits[0, :n].to(torch.float32, copy=True), hidden


class KVSession:
    """`length` tokens are committed in the cache; slots past it, up to `cached`, hold this step's
    tree nodes. With `keep_hidden`, `hidden` holds the last forward's hidden states at `hidden_layers`
    (by default the final ones) [n, len(hidden_layers) x H], one row per new token (what an acceptance
    head or a feature-conditioned draft reads: `target_features`). With `static` (dyspec.forward.static)
    the cache is preallocated and written in place, and forwards run at bucketed sizes; `cache` is
    the model's own otherwise (a lean forward's, dyspec.forward.lean), else a growing one. With
    `draft_vocab`, a draft with a reduced vocabulary (dyspec.core.vocab) returns logits over it alone.
    With `bool_mask` its forwards get boolean masks (True where visible), which a lean forward reads
    and which cost fewer ops to build than the additive ones Hugging Face's forwards read."""

    def __init__(
        self,
        model: PreTrainedModel,
        keep_hidden: bool = False,
        hidden_layers: tuple[int, ...] = FINAL,
        static: StaticModel | None = None,
        cache=None,
        draft_vocab: bool = False,
        bool_mask: bool = False,
    ):
        self.model = model
        self.bool_mask = bool_mask
        self.device = model.device
        self.static = static
        if static is not None:
            cache = static.cache
        elif cache is None:
            cache = NoCache() if draft_model(model).cacheless else DynamicCache(config=model.config)
        self.cache = cache
        self.cache_kwarg = cache_kwarg(model.forward)
        self.length = 0
        self.cached = 0  # kept here as the cache fills: a static cache keeps its length on the device
        self.forwards = 0
        self.keep_hidden = keep_hidden
        self.hidden_layers = hidden_layers
        self.hidden: torch.Tensor | None = None
        self.compiled = False  # its masks made by compiled programs (`dyspec.core.programs`) in a step on the device
        self.draft_vocab = draft_vocab and getattr(draft_model(model), "vocab", None) is not None

    def _size(self, n: int, pad_to: int = 0) -> int:
        """The size a forward of n tokens runs at: `pad_to` at least, on the static path its bucket."""
        size = max(n, pad_to)
        if self.static is not None:
            size = bucket(size)
            if self.cached + size > self.static.capacity:
                raise DyspecError(
                    f"the static cache holds {self.static.capacity} tokens; this forward needs {self.cached + size}"
                )
        return size

    def tree_mask_at(self, n: int) -> tuple:
        """`tree_mask`'s arguments after `visible` for the next forward, of n tree tokens: in a step on
        the device, the program that makes a forward's inputs makes its mask too (`forward`'s `mask`)."""
        size = self._size(n)
        width = self.cached + size if self.static is None else self.static.capacity
        return self.length, self.cached, size, width, self.bool_mask, self.model.dtype

    def _mask(self, n: int, size: int, visible: torch.Tensor | None) -> torch.Tensor | None:
        """The mask [1, 1, size, cache width] of a forward of n tokens padded to `size`: every token
        sees the committed prefix, then `visible` over the uncommitted slots and new tokens (None:
        causal; made on the host: a tree on the device brings its own, `forward`'s `mask`), the
        padding itself alone. Boolean with `bool_mask`, else additive. None where plain causal
        attention does it."""
        start, width = self.cached, self.cached + size if self.static is None else self.static.capacity
        if visible is None and size == n and self.static is None:
            return None
        if size == n and self.static is None:  # a tree's step: each op here costs a step microseconds
            see = torch.ones(n, width, dtype=torch.bool, device=self.device)
            see[:, self.length :] = visible.to(self.device, non_blocking=True)
        else:  # made on the host and copied once (on a GPU every op on the device is a launch)
            own = start - self.length + size  # uncommitted slots and this forward's tokens
            see = torch.zeros(size, width, dtype=torch.bool)
            see[:, : self.length] = True
            block = see[:, self.length : start + size]
            block[:n, : own - size + n] = (
                torch.ones(n, own - size + n).tril(own - size).bool() if visible is None else visible
            )
            block[n:, own - size + n :] = torch.eye(size - n, dtype=torch.bool)
            see = see.to(self.device, non_blocking=True)
        if self.bool_mask:
            return see[None, None]
        mask = torch.zeros(see.shape, dtype=self.model.dtype, device=self.device)
        return mask.masked_fill_(~see, torch.finfo(self.model.dtype).min)[None, None]

    @torch.inference_mode()
    def forward(
        self,
        tokens: list[int] | torch.Tensor,
        positions: list[int] | torch.Tensor | None = None,
        visible: torch.Tensor | None = None,
        last_only: bool = False,
        features: torch.Tensor | None = None,
        pad_to: int = 0,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append `tokens` to the cache and return their logits [n, V] (fp32; V the draft's
        vocabulary with `draft_vocab`).

        `visible` [n, cached - length + n] (bool) says which uncommitted cache slots and new tokens
        each new token attends to (every token attends to the committed prefix); None means plain
        causal attention. `positions` default to consecutive positions after the cache. `features`
        [n, H or its feature_size] (or with the batch axis, [1, n, ...]) go to a feature-conditioned
        draft. Tokens and positions may be int64 tensors on the device (a tree grown there:
        dyspec.core.tree_tensors), which it takes without reading them, or `tokens` both as one [2, n]
        tensor (`ids`, as a program makes them: one op fewer), `positions` None.
        `pad_to`: run the forward at that many tokens (where the profile says it is cheaper,
        `dyspec.auto.cost.padded_size`; the static path pads to its bucket); the padding attends to itself
        alone, no token attends to it, its logits and hidden states are not returned, and `commit`
        drops its cache slots. `mask`: the forward's mask, made where its tokens were
        (`tree_mask_at`), instead of `visible`.
        """
        on_device = isinstance(tokens, torch.Tensor)
        n, start = tokens.shape[-1] if on_device else len(tokens), self.cached
        size = self._size(n, pad_to)
        if positions is None and not on_device:
            positions = list(range(start, start + n))
        mask = self._mask(n, size, visible) if mask is None else mask
        pad = size - n
        if on_device:
            ids = tokens if tokens.dim() == 2 else torch.stack([tokens, positions])
            ids = ids if ids.device == self.device else ids.to(self.device)
            ids = torch.cat([ids, ids[:, -1:].expand(2, pad)], 1) if pad else ids
        else:  # one copy to the device, not two
            ids = torch.tensor([tokens + tokens[-1:] * pad, positions + positions[-1:] * pad], device=self.device)
        extra = {}
        if features is not None:
            features = features if features.dim() == 3 else features[None]
            if pad:
                features = torch.cat([features, features[:, -1:].expand(-1, pad, -1)], 1)
            features = features if features.device == self.device else features.to(self.device)
            extra["input_features"] = features
        if self.draft_vocab:
            extra["draft_vocab"] = True
        keep = 1 if last_only else 0
        if last_only and (pad or self.static is not None):
            # the last token's row, not the padding's; as an index, so that a bucket has one shape
            keep = torch.tensor([n - 1], device=self.device)
        run = self.static.run if self.static is not None and (size, last_only) in self.static.compiled else self.model
        if run is not self.model:
            torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs were copied out
        with MODEL_CALL.get()():
            out = run(
                input_ids=ids[:1],
                position_ids=ids[1:],
                attention_mask=mask,
                **{self.cache_kwarg: self.cache},
                use_cache=True,
                logits_to_keep=keep,
                output_hidden_states=self.keep_hidden,
                **extra,
            )
        self.cached, self.forwards = start + size, self.forwards + 1
        return self._outputs(out, n, on_device)

    def _outputs(self, out: Output, n: int, on_device: bool) -> torch.Tensor:
        """The logits [n, V] in float32 of the forward's n tokens, its padding's dropped; with
        `keep_hidden` its features kept in `hidden`. Copies where a compiled forward's outputs are
        overwritten by its next replay: in a step on the device, one program."""
        if on_device and self.compiled and self.static is not None:
            features = tuple(out.hidden_states[i] for i in self.hidden_layers) if self.keep_hidden else None
            logits, self.hidden = copied_out(out.logits, features, n, compiled=True)
            return logits
        if self.keep_hidden:
            hidden = target_features(out.hidden_states, self.hidden_layers)[0, :n]
            self.hidden = hidden.clone() if self.static is not None else hidden
        logits = out.logits[0, :n]
        # a `to` that copies nothing is still an op to dispatch
        copy = self.static is not None or logits.dtype != torch.float32
        return logits.to(torch.float32, copy=True) if copy else logits

    def append(self, tokens: list[int], **kwargs) -> torch.Tensor:
        """`forward` the next committed tokens (a prompt), causally, and commit them."""
        logits = self.forward(tokens, **kwargs)
        self.commit(list(range(self.length, self.length + len(tokens))))
        return logits

    @torch.inference_mode()
    def commit(self, slots: list[int]) -> None:
        """Keep the committed prefix plus the cache slots `slots` (absolute, in order), moved in place to
        contiguous positions right after it; drop every other uncommitted slot."""
        keep = self.length + len(slots)
        if slots != list(range(self.length, keep)):
            # a stacked cache (`LeanCache.stacked`) moves every layer's slots at once
            caches = getattr(self.cache, "stacked", None) or [t for x in self.cache.layers for t in (x.keys, x.values)]
            keep_slots(caches, slots, self.length)
        self.cache.crop(keep - self.cached)  # a negative count removes that many from the end
        self.length = self.cached = keep
