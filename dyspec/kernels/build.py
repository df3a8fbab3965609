"""Building dyspec's C++ kernels: one compile helper, the C++ compiler and the CPU's features."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from filelock import FileLock
from tqdm.auto import tqdm

from dyspec.cache import cache_dir


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    return frozenset(cpuinfo.read_text().split()) if cpuinfo.exists() else frozenset()


def build(source: Path, flags: list[str]) -> Path:
    """A kernel's shared library (int8_mm.cpp, row_attention.cpp), compiled once per source, flags,
    PyTorch and Python version."""
    from torch.utils.cpp_extension import include_paths, library_paths

    what = source_bytes(source) + f"{flags} {torch.__version__} {sys.version}".encode()
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
            cmd += [f"-I{p}" for p in [*include_paths(), source.parent]] + [str(source), "-o", str(tmp)]
            cmd += [f"-L{p}" for p in library_paths()] + ["-lc10", "-ltorch_cpu"]
            with tqdm(total=1, desc=f"building dyspec's {source.stem} kernel (once per machine)") as bar:
                subprocess.run(cmd, check=True, capture_output=True)
                bar.update()
            tmp.replace(out)
    return out


# what a failed `build` or library load raises
BUILD_ERRORS = (OSError, subprocess.CalledProcessError)


def build_failure(error: Exception) -> str:
    """What a failed build says, for the one-line warning a kernel's fallback gives: the end of the
    compiler's output, or the error."""
    if isinstance(error, subprocess.CalledProcessError):
        return error.stderr.decode()[-2000:]
    return str(error)


def source_bytes(source: Path) -> bytes:
    """A kernel's source and the headers beside it that it may include: what its build is named by."""
    return b"\0".join(p.read_bytes() for p in [source, *sorted(source.parent.glob("*.h"))])


def cpp_compiler() -> str | None:
    """The C++ compiler of this machine, which torch.compile and this kernel build with: $CXX, or
    the first of c++, g++ and clang++ found."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next(filter(None, map(shutil.which, names)), None)
