"""One model and its KV cache, with forwards over token trees and commits of an accepted path."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from transformers import DynamicCache, PreTrainedModel

FINAL = (-1,)  # the target layers a feature draft reads by default: its final hidden state alone


def target_features(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...] = FINAL) -> torch.Tensor:
    """What a feature draft reads from a target forward run with `output_hidden_states=True`: the
    hidden states at `layers` (indices into `hidden_states`; -1, the final one after the final
    norm, last), concatenated on the last axis."""
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


def cache_kwarg(forward: Callable) -> str:
    """The name a forward takes its KV cache by: `cache` since transformers 5.24 (`past_key_values`
    still works there, with a FutureWarning on stderr), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that wall-clock timings measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class KVSession:
    """`length` tokens are committed in the cache; slots past it hold this step's tree nodes.
    With `keep_hidden`, `hidden` holds the last forward's hidden states at `hidden_layers` (by default
    the final ones) [n, len(hidden_layers) x H], one row per new token (what an acceptance head or a
    feature-conditioned draft reads: `target_features`)."""

    def __init__(self, model: PreTrainedModel, keep_hidden: bool = False, hidden_layers: tuple[int, ...] = FINAL):
        self.model = model
        self.device = model.device
        self.cache = DynamicCache(config=model.config)
        self.cache_kwarg = cache_kwarg(model.forward)
        self.length = 0
        self.forwards = 0
        self.keep_hidden = keep_hidden
        self.hidden_layers = hidden_layers
        self.hidden: torch.Tensor | None = None

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(
        self,
        tokens: list[int],
        positions: list[int] | None = None,
        visible: torch.Tensor | None = None,
        last_only: bool = False,
        features: torch.Tensor | None = None,
        pad_to: int = 0,
    ) -> torch.Tensor:
        """Append `tokens` to the cache and return their logits [n, V] (fp32).

        `visible` [n, cached + n] (bool) says which cache slots and new tokens each new token attends
        to; None means plain causal attention over everything before it. `positions` default to
        consecutive positions after the cache. `features` [n, H or its feature_size] go to a feature-conditioned draft.
        `pad_to`: run the forward at that many tokens (where the profile says it is cheaper,
        `budget.padded_size`); the padding attends to itself alone, no token attends to it, its
        logits and hidden states are not returned, and `commit` drops its cache slots.
        """
        n, start = len(tokens), self.cached
        if positions is None:
            positions = list(range(start, start + n))
        if pad_to > n:
            if visible is None:
                visible = torch.ones(n, start + n, dtype=torch.bool).tril(start)
            pad = pad_to - n
            visible = torch.cat([visible, torch.zeros(n, pad, dtype=torch.bool)], dim=1)
            visible = torch.cat([visible, torch.eye(start + pad_to, dtype=torch.bool)[start + n :]])
            tokens, positions = tokens + tokens[-1:] * pad, positions + positions[-1:] * pad
        mask = None
        if visible is not None:
            mask = torch.zeros(visible.shape, dtype=self.model.dtype, device=self.device)
            mask.masked_fill_(~visible.to(self.device), torch.finfo(self.model.dtype).min)
            mask = mask[None, None]
        extra = {} if features is None else {"input_features": features[None].to(self.device)}
        out = self.model(
            input_ids=torch.tensor([tokens], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            attention_mask=mask,
            **{self.cache_kwarg: self.cache},
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            output_hidden_states=self.keep_hidden,
            **extra,
        )
        self.forwards += 1
        if self.keep_hidden:
            self.hidden = target_features(out.hidden_states, self.hidden_layers)[0, :n]
        return out.logits[0, :n].float()

    def commit(self, slots: list[int]) -> None:
        """Keep the committed prefix plus the cache slots `slots` (absolute, in order), moved to
        contiguous positions right after it; drop every other uncommitted slot."""
        keep = self.length + len(slots)
        if slots == list(range(self.length, keep)):
            self.cache.crop(keep - self.cached)  # a negative count removes that many from the end
        else:
            idx = torch.tensor(list(range(self.length)) + slots, device=self.device)
            for layer in self.cache.layers:
                layer.keys = layer.keys.index_select(2, idx)
                layer.values = layer.values.index_select(2, idx)
        self.length = keep
