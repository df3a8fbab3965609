"""An int8 product for decoding forwards: `int8_mm(x, operands)` = x @ W.T in int32, exact.

`torch._int_mm` (oneDNN) reads a one-row product's weights well below the memory's bandwidth and
costs several times its one-row time at a few rows, which is what makes a token tree cost more
than a token. This kernel (int8_mm.cpp, AVX-512 VNNI) reads weights packed in the order it uses
them once for up to 8 rows, on every core, so a few rows cost about what one row costs. Where the
CPU has AMX (Xeons since Sapphire Rapids), a tree's rows run on its tile unit, whose arithmetic
is many times VNNI's: at 8 to 16 rows VNNI's arithmetic, not the weights' reading, is the bound.

Its sums are int32, exact, so its result equals `torch._int_mm`'s whatever the row count: a CPU
without AVX-512 VNNI, or a machine where the build fails, runs `torch._int_mm` and gets the same
numbers. The kernel is compiled on first use with the system's C++ compiler against the installed
PyTorch (once per machine: the library is kept in dyspec's cache folder).
"""

from __future__ import annotations

import functools
import platform
import subprocess
import warnings
from pathlib import Path

import torch

from dyspec.kernels.build import build, cpu_flags

PANEL = 32  # outputs per packed panel, as in int8_mm.cpp
SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = {"avx512f", "avx512bw", "avx512_vnni"}
AMX_FLAGS = {"amx_tile", "amx_int8"}
VNNI_BUILD = ["-mavx512f", "-mavx512bw", "-mavx512vnni"]
AMX_BUILD = ["-mamx-tile", "-mamx-int8"]


@functools.cache
def kernel_available() -> bool:
    """Whether `dyspec::int8_mm` runs here: an x86 CPU with AVX-512 VNNI and a C++ compiler that
    builds it (built now if not yet), with its AMX path where the CPU has AMX and the compiler
    knows it."""
    if platform.machine() != "x86_64" or not FLAGS <= cpu_flags():
        return False
    builds = [VNNI_BUILD + AMX_BUILD, VNNI_BUILD] if AMX_FLAGS <= cpu_flags() else [VNNI_BUILD]
    for flags in builds:
        try:
            torch.ops.load_library(str(build(SOURCE, flags)))
            return True
        except (OSError, subprocess.CalledProcessError) as e:
            detail = e.stderr.decode()[-2000:] if isinstance(e, subprocess.CalledProcessError) else str(e)
    warnings.warn(f"dyspec's int8 kernel did not build; int8 products run torch._int_mm:\n{detail}", stacklevel=2)
    return False


def use_amx(allow: bool) -> bool:
    """Allow products of a few rows or more on AMX's tiles, or keep them on VNNI (for tests and
    benchmarks: both are exact, so results do not change); returns whether AMX runs."""
    return kernel_available() and torch.ops.dyspec.int8_mm_amx(allow)


def packable(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return out_features % PANEL == 0 and in_features % 4 == 0


def int8_operands(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An int8 weight [N, K] as `int8_mm` reads it: packed [N / 32, K / 4, 32, 4] with 128 * its row
    sums (the kernel's offset, see int8_mm.cpp), where the kernel runs and the shape suits it; else
    its transpose for `torch._int_mm` (the fastest layout measured at one row) and None."""
    if not (kernel_available() and packable(weight)):
        return weight.t(), None
    n, k = weight.shape
    packed = weight.view(n // PANEL, PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    return packed, 128 * weight.sum(1, dtype=torch.int32)


def int8_mm(x: torch.Tensor, weight: torch.Tensor, comp: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] int8 @ the weight `int8_operands` gave: int32 [M, N], exact."""
    if comp is None:
        return torch._int_mm(x, weight)
    return torch.ops.dyspec.int8_mm(x, weight, comp)


_library = torch.library.Library("dyspec", "DEF")
_library.define("int8_mm(Tensor x, Tensor w, Tensor comp) -> Tensor")


@torch.library.register_fake("dyspec::int8_mm")
def _(x: torch.Tensor, weight: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], comp.shape[0], dtype=torch.int32)
