"""Turning logits into the distributions that drafts sample from and verifiers check against."""

from __future__ import annotations

import torch


def to_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax at `temperature` in fp32; at temperature 0, one-hot on the argmax (never logits / 0)."""
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what to sample from after a rejection. A zero residual (p == q up to
    rounding, where rejection had probability 0) falls back to p."""
    r = (p - q).clamp_min_(0)
    total = r.sum()
    return r / total if total > 0 else p
