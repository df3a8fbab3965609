"""An int8 product for decoding forwards: `int8_mm(x, operands)` = x @ W.T in int32, exact.

`torch._int_mm` (oneDNN) reads a one-row product's weights at ~17 GB/s on a 2-core CPU and costs
2-4x its one-row time at 2-8 rows, which is what makes a token tree cost more than a token. This
kernel (int8_mm.cpp, AVX-512 VNNI) reads weights packed in the order it uses them once for up to 8
rows, on every core: ~32 GB/s, and 8 rows cost about what one row costs.

Its sums are int32, exact, so its result equals `torch._int_mm`'s whatever the row count: a CPU
without AVX-512 VNNI, or a machine where the build fails, runs `torch._int_mm` and gets the same
numbers. The kernel is compiled on first use with the system's C++ compiler against the installed
PyTorch (~10 s, once per machine; the library is kept in dyspec's cache folder).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from filelock import FileLock
from tqdm.auto import tqdm

from dyspec.models.cache import cache_dir
from dyspec.models.quant import cpu_flags

PANEL = 32  # outputs per packed panel, as in int8_mm.cpp
SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = {"avx512f", "avx512bw", "avx512_vnni"}


@functools.cache
def kernel_available() -> bool:
    """Whether `dyspec::int8_mm` runs here: an x86 CPU with AVX-512 VNNI and a C++ compiler that
    builds it (built now if not yet)."""
    if platform.machine() != "x86_64" or not FLAGS <= cpu_flags():
        return False
    try:
        torch.ops.load_library(str(build(SOURCE, ["-mavx512f", "-mavx512bw", "-mavx512vnni"])))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode()[-2000:] if isinstance(e, subprocess.CalledProcessError) else str(e)
        warnings.warn(f"dyspec's int8 kernel did not build; int8 products run torch._int_mm:\n{detail}", stacklevel=2)
        return False
    return True


def build(source: Path, flags: list[str]) -> Path:
    """A kernel's shared library (int8_mm.cpp, row_attention.cpp), compiled once per source, flags,
    PyTorch and Python version."""
    from torch.utils.cpp_extension import include_paths, library_paths

    what = source.read_bytes() + f"{flags} {torch.__version__} {sys.version}".encode()
    out = cache_dir() / "kernels" / f"{source.stem}-{hashlib.sha256(what).hexdigest()[:16]}.so"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{out}.lock"):  # test workers, an app and a notebook may build at once
        if not out.exists():
            tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
            abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
            cxx = cpp_compiler()
            if cxx is None:
                raise OSError("no C++ compiler found (c++, g++, clang++ or $CXX)")
            cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", *flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
            cmd += [f"-I{p}" for p in include_paths()] + [str(source), "-o", str(tmp)]
            cmd += [f"-L{p}" for p in library_paths()] + ["-lc10", "-ltorch_cpu"]
            with tqdm(total=1, desc=f"building dyspec's {source.stem} kernel (once per machine)") as bar:
                subprocess.run(cmd, check=True, capture_output=True)
                bar.update()
            tmp.replace(out)
    return out


def cpp_compiler() -> str | None:
    """The C++ compiler of this machine, which torch.compile and this kernel build with: $CXX, or
    the first of c++, g++ and clang++ found."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next(filter(None, map(shutil.which, names)), None)


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
