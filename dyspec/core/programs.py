"""The step on the device's tensor programs, compiled: each is a pure function of tensors that runs
as its ops one by one (eager), or, where the pair's forward is compiled, as one compiled program
(torch.compile: Inductor's fused kernels on a CPU or a GPU). Eager, a round of a tree costs a
dispatch per op, a kernel launch each on a GPU; compiled, one call of a few fused kernels.

A program runs the same tensor code either way, so the eager run is its reference; compiled code
may round floating-point sums in another order, so a compiled program's draft distribution may
differ from the eager one's in the last bits. That never touches exactness: verification tests
each node against the very distribution it was drawn from (`TreeTensors.q`), and at T = 0 against
the target's argmax alone. A program that fails to compile runs eager from then on, with a warning.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from typing import TypeVar

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

F = TypeVar("F", bound=Callable)

# what wraps each compiled program's call (`dyspec.eval.anatomy` counts it as one op there)
PROGRAM_CALL: ContextVar[Callable[[], AbstractContextManager]] = ContextVar("program_call", default=nullcontext)
FAILED: set[str] = set()  # programs that did not compile here, by name: they run eager


VERSIONS_ALLOWED: ContextVar[bool] = ContextVar("versions_allowed", default=False)


def allow_versions() -> None:
    """Room for each program's versions: torch.compile makes one per kind of its arguments (a draft
    with features or without, a tree of one row, a dtype), and a process that runs several pairs
    (the app, the tests) makes more than its default of 8, past which a program runs eager, op by
    op, without a word. Dynamo's settings are per thread (a context variable each), so each
    thread that runs programs sets them."""
    if VERSIONS_ALLOWED.get():
        return
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 64)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 1024)
    VERSIONS_ALLOWED.set(True)


def program(fn: F) -> F:
    """`fn` callable as before, and with `compiled=True` as one compiled program, its shapes and ints
    symbolic (one program for every budget and step; a few recompiles where torch.compile
    specializes a size of 0 or 1)."""
    compiled_fn = torch.compile(fn, fullgraph=True, dynamic=True)

    @functools.wraps(fn)
    def run(*args, compiled: bool = False, **kwargs):
        if not compiled or fn.__qualname__ in FAILED:
            return fn(*args, **kwargs)
        allow_versions()
        try:
            with PROGRAM_CALL.get()():
                return compiled_fn(*args, **kwargs)
        except FailOnRecompileLimitHit:  # shapes past torch.compile's count of versions: this call eager
            return fn(*args, **kwargs)
        except TorchDynamoException as e:  # a compiler's failure, before anything ran
            FAILED.add(fn.__qualname__)
            warnings.warn(f"{fn.__qualname__} did not compile here; it runs eager, slower: {e}", stacklevel=2)
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
