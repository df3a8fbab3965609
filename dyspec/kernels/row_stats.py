"""Each row's argmax and logsumexp over the vocabulary: `row_stats(logits)`, what greedy
verification and the views' target probabilities read from the target's logits at every step.

PyTorch's CPU argmax over a row of a large vocabulary runs an element at a time, and its
logsumexp takes several passes: per step and per tree row they cost more than the rest of the
step's bookkeeping. The kernel (row_stats.cpp) reads a float32 row twice in vector arithmetic: its
largest entry, then its first index and the sum of exponentials. The argmax is torch.argmax's (the
first largest entry; a NaN counts as largest), so greedy decoding keeps its tokens; the logsumexp
agrees with torch.logsumexp to float32 rounding. Other tensors (a GPU's, bf16), and a machine
without a C++ compiler, take PyTorch's ops.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from dyspec.kernels.build import build, cpp_compiler

SOURCE = Path(__file__).with_suffix(".cpp")


@functools.cache
def kernel_available() -> bool:
    """Whether the kernel runs here (built now if not yet): it needs a C++ compiler."""
    if cpp_compiler() is None:
        return False
    torch.ops.load_library(str(build(SOURCE, ["-march=native"])))
    return True


def row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V]: each row's argmax (int64) and logsumexp (float32), shaped [...]."""
    if logits.is_cpu and logits.dtype == torch.float32 and kernel_available():
        return torch.ops.dyspec.row_stats(logits)
    return logits.argmax(-1), torch.logsumexp(logits.float(), -1)
