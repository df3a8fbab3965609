"""A few entries of a tensor read and written as Python floats: what a step's host work does to the
logits (a node's probability, a copy's mixture). On a CPU through numpy: that work runs in caches
the target's weights have just swept, where each tensor op costs far more than its arithmetic;
elsewhere as one gather or one scatter on the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def read(t: torch.Tensor, at: Sequence[tuple[int, int]]) -> list[float]:
    """t[r, c] for each (r, c) of `at`, t [rows, columns]."""
    if _numpy(t):
        table = t.numpy()
        return [float(table[r, c]) for r, c in at]
    return t.flatten()[_flat(t, at)].tolist()


def write(t: torch.Tensor, at: Sequence[tuple[int, int]], values: Sequence[float]) -> None:
    """t[r, c] = each value, in place."""
    if _numpy(t):
        table = t.numpy()
        for (r, c), v in zip(at, values):
            table[r, c] = v
        return
    t.view(-1)[_flat(t, at)] = torch.tensor(values, dtype=t.dtype, device=t.device)


def _numpy(t: torch.Tensor) -> bool:
    """Whether numpy reads t in place: a CPU tensor of a dtype it has (not bf16)."""
    return t.is_cpu and t.dtype in (torch.float32, torch.float64)


def _flat(t: torch.Tensor, at: Sequence[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor([r * t.shape[-1] + c for r, c in at], device=t.device)
