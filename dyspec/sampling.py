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
    """One draw from a 1-D distribution by inverse CDF (float64 cumsum): ~20x faster than
    torch.multinomial over a 49k-token vocabulary on a CPU (0.05 vs 1 ms), which matters when a
    chain draws a token per node. Zero-probability tokens are never drawn (`right=True`)."""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), dtype=torch.float64, generator=generator, device=probs.device) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_max(len(cdf) - 1))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what to sample from after a rejection. A zero residual (p == q up to
    rounding, where rejection had probability 0) falls back to p."""
    r = (p - q).clamp_min_(0)
    total = r.sum()
    return r / total if total > 0 else p


def ranked_children(
    q: torch.Tensor, k: int, sample: bool, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k children of each row of q [n, V], in drawing order: a sample without replacement
    (exponential race: the top k of q / E with E ~ Exp(1), equivalent to Gumbel-top-k) or simply the
    top k. Returns tokens [n, k] and their probabilities under q; children past q's support come
    last with probability 0, and callers skip them. E is drawn as -log(U): 0.17 ms per 49k-token
    row on a CPU against 0.94 ms for `exponential_`, paid for every row a tree forwards."""
    keys = q
    if sample:
        keys = q / torch.rand(q.shape, generator=generator, device=q.device).log_().neg_()
    idx = keys.topk(min(k, q.shape[-1]), dim=-1).indices
    return idx, q.gather(-1, idx)
