"""An int8 product for decoding forwards: `int8_mm(x, operands)` = x @ W.T in int32, exact.

`torch._int_mm` (oneDNN) reads a one-row product's weights well below the memory's bandwidth and
costs several times its one-row time at a few rows, which is what makes a token tree cost more
than a token. This kernel (int8_mm.cpp) reads weights packed in the order it uses them once for
all the rows of a decoding forward, on every core, so a few rows cost about what one row costs. It
runs the fastest of four paths the CPU has: AMX's tiles (Xeons since Sapphire Rapids), AVX-512
VNNI (Xeons, AMD since Zen 4), AVX-VNNI (Intel laptops since Alder Lake: VNNI at half the width,
without AVX-512), or AVX2 (every x86-64 laptop of the last decade); `use_path`, or
DYSPEC_INT8_PATH=vnni, avx-vnni or avx2 in the environment, forces a slower one. A CPU with AVX-512
VNNI runs the AVX-VNNI path's arithmetic when forced to it, in its own encoding of the same
instruction, which is how that path is tested where no AVX-VNNI laptop is at hand.

Its sums are int32, exact, so its result equals `torch._int_mm`'s whatever the path and the row
count: a CPU without AVX2 (ARM), or a machine where the build fails, runs `torch._int_mm` and gets
the same numbers. The kernel is compiled on first use with the system's C++ compiler against the
installed PyTorch (once per machine: the library is kept in dyspec's cache folder).
"""

from __future__ import annotations

import functools
import os
import platform
import warnings
from pathlib import Path

import torch

from dyspec.kernels.build import BUILD_ERRORS, build, build_failure, cpu_flags

PANEL = 32  # outputs per packed panel, as in int8_mm.cpp
SOURCE = Path(__file__).with_suffix(".cpp")
# whether oneDNN's `torch._int_mm` multiplies int8 at speed here: with AVX-512 VNNI it is the fastest
# at a prompt's many rows; without, it runs int8 at a small fraction of this kernel's speed (and a
# path forced below AVX-512 stands for a CPU without it, prompts included)
ONEDNN_INT8 = "avx512_vnni" in cpu_flags() and os.environ.get("DYSPEC_INT8_PATH") not in ("avx-vnni", "avx2")
PATHS = ("amx", "vnni", "avx-vnni", "avx2")  # fastest first
# builds to try, fastest first: the CPU flags each needs, and the compiler's
BUILDS = (
    (
        {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"},
        ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mamx-tile", "-mamx-int8"],
    ),
    ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]),
    ({"avx2", "avx_vnni"}, ["-mavx2", "-mavxvnni"]),
    ({"avx2"}, ["-mavx2"]),
)


@functools.cache
def kernel_available() -> bool:
    """Whether `dyspec::int8_mm` runs here: an x86 CPU with AVX2 at least and a C++ compiler that
    builds it (built now if not yet), with the fastest path the CPU and the compiler both have."""
    builds = [flags for needs, flags in BUILDS if needs <= cpu_flags()] if platform.machine() == "x86_64" else []
    for flags in builds:
        try:
            torch.ops.load_library(str(build(SOURCE, flags)))
            if os.environ.get("DYSPEC_INT8_PATH"):  # a slower path forced, to measure it
                torch.ops.dyspec.int8_mm_path(os.environ["DYSPEC_INT8_PATH"])
            return True
        except BUILD_ERRORS as e:
            detail = build_failure(e)
    if builds:
        warnings.warn(f"dyspec's int8 kernel did not build; int8 products run torch._int_mm:\n{detail}", stacklevel=2)
    else:
        warnings.warn(
            "dyspec's int8 kernel needs an x86-64 CPU with AVX2: int8 products run torch._int_mm, the same "
            "tokens, slower at several rows",
            stacklevel=2,
        )
    return False


def use_path(path: str) -> str | None:
    """Run products on `path` (one of PATHS) or a slower one the CPU has, for tests and
    benchmarks (every path gives the same sums); returns the path in use, None without the kernel."""
    if path not in PATHS:
        raise ValueError(f"an int8 kernel path is one of {', '.join(PATHS)}, not {path}")
    return torch.ops.dyspec.int8_mm_path(path) if kernel_available() else None


def kernel_path() -> str:
    """What a decoding forward's int8 products run on here: one of PATHS, or "torch._int_mm"
    without the kernel."""
    return torch.ops.dyspec.int8_mm_path("") if kernel_available() else "torch._int_mm"


def packable(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return out_features % PANEL == 0 and in_features % 4 == 0


def int8_operands(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """An int8 weight [N, K] as `int8_mm` reads it: packed [N / 32, K / 4, 32, 4] with 128 * its row
    sums (the VNNI path's offset, see int8_mm.cpp), where the kernel runs and the shape suits it,
    else None for both; and its transpose [K, N] for `torch._int_mm` (the fallback, and a prompt's
    products where oneDNN is fast)."""
    plain = weight.t()
    if not (kernel_available() and packable(weight)):
        return plain, None, plain
    n, k = weight.shape
    packed = weight.view(n // PANEL, PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    return packed, 128 * weight.sum(1, dtype=torch.int32), plain


def int8_mm(
    x: torch.Tensor, weight: torch.Tensor, comp: torch.Tensor | None, plain: torch.Tensor, prompt: bool = False
) -> torch.Tensor:
    """x [M, K] int8 @ the weight `int8_operands` gave: int32 [M, N], exact. `prompt`: many rows,
    which run oneDNN's `torch._int_mm` where it is fast (`ONEDNN_INT8`)."""
    if comp is None or (prompt and ONEDNN_INT8):
        return torch._int_mm(x, plain)
    return torch.ops.dyspec.int8_mm(x, weight, comp)


_library = torch.library.Library("dyspec", "DEF")
_library.define("int8_mm(Tensor x, Tensor w, Tensor comp) -> Tensor")


@torch.library.register_fake("dyspec::int8_mm")
def _(x: torch.Tensor, weight: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], comp.shape[0], dtype=torch.int32)
