"""Rows over the vocabulary, read at every step: each row's argmax and logsumexp (`row_stats`), what
greedy verification and the views' target probabilities read from the target's logits, and draws
by inverse CDF (`inverse_cdf`), what sampled verification and a sampled draft take.

PyTorch's CPU argmax over a row of a large vocabulary runs an element at a time, and its logsumexp
takes several passes, and a step pays them for every row of its tree. The kernel (row_stats.cpp)
reads a float32 row twice in vector arithmetic: its largest entry, then its first index and the sum
of exponentials. The argmax is torch.argmax's (the first largest entry; a NaN counts as largest),
so greedy decoding keeps its tokens; the logsumexp agrees with torch.logsumexp to float32 rounding.
A draw takes the first column whose cumulative sum, in double, passes u times the row's total, as
`torch.searchsorted` over a float64 cumsum does, and never a column of probability 0. Other tensors
(a GPU's, bf16), and a machine without a C++ compiler or where the kernel does not build, take
PyTorch's ops.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

from dyspec.kernels.build import BUILD_ERRORS, build, build_failure, cpp_compiler

SOURCE = Path(__file__).with_suffix(".cpp")


@functools.cache
def kernel_available() -> bool:
    """Whether the kernel runs here (built now if not yet): it needs a C++ compiler."""
    if cpp_compiler() is None:
        return False
    try:
        torch.ops.load_library(str(build(SOURCE, ["-march=native"])))
    except BUILD_ERRORS as e:
        detail = build_failure(e)
        warnings.warn(
            f"dyspec's row kernel did not build; argmax and draws run PyTorch's, slower:\n{detail}", stacklevel=2
        )
        return False
    return True


def row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V]: each row's argmax (int64) and logsumexp (float32), shaped [...]."""
    # inside a compiled program (dyspec.core.programs) the compiler fuses PyTorch's own
    if logits.is_cpu and logits.dtype == torch.float32 and not torch.compiler.is_compiling() and kernel_available():
        return torch.ops.dyspec.row_stats(logits)
    return logits.argmax(-1), torch.logsumexp(logits.float(), -1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draws [rows, n] from probs [rows, V] (each row's total need not be 1) at uniforms u [rows, n]
    in [0, 1), float64: the first column whose cumulative sum passes u times its row's total."""
    # inside a compiled program (dyspec.core.programs) the compiler's own cumsum and search
    if probs.is_cpu and probs.dtype == torch.float32 and not torch.compiler.is_compiling() and kernel_available():
        return torch.ops.dyspec.inverse_cdf(probs, u)
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_max(probs.shape[-1] - 1)
