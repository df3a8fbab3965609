"""What a draft model declares (`DraftModel`), so that the engine reads a draft's abilities instead of
probing for them: dyspec's own drafts (dyspec.drafts) set them as attributes; a Hugging Face causal LM
drafts as a plain model (`PLAIN`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from transformers import PreTrainedModel

FINAL = (-1,)  # the target layers a feature draft reads by default: its final hidden state alone


class DraftModel(Protocol):
    needs_features: bool  # reads, with each token, the target's features at the token before it
    feature_layers: tuple[int, ...]  # the target layers those come from (indices into hidden_states)
    reads_first_token: bool  # reads the prompt's first token (EAGLE's published drafts start at the second)
    copy_weights: list[float] | None  # per match length: copies repeats of its context (dyspec.core.copying)
    cacheless: bool  # attends to nothing, so keeps no KV cache (Medusa's heads)
    runs_lean: bool  # its own decoder layers can run as the lean forward's (dyspec.forward.lean)
    vocab: torch.Tensor | None  # the target tokens it reads out, where fewer than all (dyspec.core.vocab)


@dataclass(frozen=True)
class PlainDraft:
    """A causal LM drafting from tokens alone."""

    needs_features: bool = False
    feature_layers: tuple[int, ...] = FINAL
    reads_first_token: bool = True
    copy_weights: list[float] | None = None
    cacheless: bool = False
    runs_lean: bool = False
    vocab: torch.Tensor | None = None


PLAIN = PlainDraft()


def draft_model(model: nn.Module) -> DraftModel:
    """What `model` declares as a draft: itself for one of dyspec's own drafts, `PLAIN` for a Hugging
    Face causal LM (which the target is too)."""
    return PLAIN if isinstance(model, PreTrainedModel) else model
