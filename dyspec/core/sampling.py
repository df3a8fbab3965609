"""Turning logits into the distributions that drafts sample from and verifiers check against."""

from __future__ import annotations

import torch

from dyspec.core.programs import program
from dyspec.kernels.row_stats import inverse_cdf


@program
def to_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax at `temperature` in fp32; at temperature 0, one-hot on the argmax (never logits / 0)."""
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def sample_rows(probs: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """n i.i.d. draws [rows, n] from each row of probs [rows, V], by inverse CDF over float64
    cumulative sums (`dyspec.kernels.row_stats.inverse_cdf`): an order of magnitude faster than
    torch.multinomial over a large vocabulary on a CPU, which matters when a tree draws children at
    every node. Zero-probability tokens are never drawn."""
    u = torch.rand((len(probs), n), dtype=torch.float64, generator=generator, device=probs.device)
    return inverse_cdf(probs, u)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One draw from a 1-D distribution (see `sample_rows`)."""
    return int(sample_rows(probs[None], 1, generator)[0, 0])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what to sample from after a rejection. A zero residual (p == q up to
    rounding, where rejection had probability 0) falls back to p; chosen with no host read, so that
    the step on the device calls it too."""
    r = (p - q).clamp_min_(0)
    total = r.sum()
    return torch.where(total > 0, r / total, p)


def ranked_children(
    q: torch.Tensor, k: int, sample: bool, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k children of each row of q [n, V], in drawing order: a sample without replacement
    (exponential race: the top k of q / E with E ~ Exp(1), equivalent to Gumbel-top-k) or simply the
    top k. Returns tokens [n, k] and their probabilities under q; children past q's support come
    last with probability 0, and callers skip them. E is drawn as -log(U), several times faster
    on a CPU than `exponential_`, and paid for every row a tree forwards."""
    return top_children(q, k, race_uniforms(q.shape, generator, q.device) if sample else None)


def race_uniforms(
    shape: tuple[int, ...], generator: torch.Generator | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """U ~ Uniform(0, 1) [rows, V] for `top_children`'s race (E = -log U): drawn outside a compiled
    program, which takes no generator; the log is taken inside it, one op fewer."""
    return torch.rand(shape, generator=generator, device=device)


def top_children(q: torch.Tensor, k: int, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`ranked_children` with its race's `uniforms` drawn (`race_uniforms`), or None for the top k."""
    keys = q if uniforms is None else q / uniforms.log().neg()
    idx = keys.topk(min(k, q.shape[-1]), dim=-1).indices
    return idx, q.gather(-1, idx)
