"""The attention of the compiled forward's decoding rows: `row_attention(q, keys, values, slots,
counts, scale)`, each row over the cache slots it sees, read in place (row_attention.cpp).

Greedy exactness needs a tree row to compute bit for bit what the one-token forward of its path
computes (dyspec.forward.attention). Batched matrix products do not promise it: the CPU's GEMM changes
a row's last bits with the rows and key counts that share its call, so the eager forwards gather
each row's keys, pad them to a multiple of 64 and give each row its own batch entry. At decoding
sizes those are small products whose calls cost more than their arithmetic, and the gather copies
every key a tree row sees, which grows with
the context. This kernel runs the same loops for every row (dot products, softmax, the weighted sum
of values, in position order) over its own keys only, so a row's result cannot depend on what
shares the call; it reads keys where the cache holds them, and a row's query heads that share a
key head read its keys, then its values, together (as many as half the vector registers hold: one
on AVX2, so that two threads share even a one-row forward's heads). C++ with GCC's and Clang's vector extensions
(every sum in the order written): it builds wherever torch.compile does, which the compiled
forward needs anyway.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from dyspec.kernels.build import BUILD_ERRORS, build, cpp_compiler

SOURCE = Path(__file__).with_suffix(".cpp")


@functools.cache
def load() -> None:
    """Build the kernel (once per machine) and load it."""
    torch.ops.load_library(str(build(SOURCE, ["-march=native"])))


@functools.cache
def kernel_available() -> bool:
    """Whether the kernel runs here, for what has another way: it needs a C++ compiler."""
    if cpp_compiler() is None:
        return False
    try:
        load()
    except BUILD_ERRORS:
        return False
    return True


def keep_slots(caches: list[torch.Tensor], slots: list[int], start: int) -> None:
    """Move cache slots `slots` of every tensor [..., capacity, d] in `caches` to start, start + 1,
    ... in place: a commit of a tree's accepted path. Ascending slots from `start` on (a path's, in
    a cache written in tree order) take one call of the kernel for every layer on a CPU; other
    slots, devices or layouts two tensor ops a tensor."""
    if not slots:
        return
    ascending = slots[0] >= start and all(a < b for a, b in zip(slots, slots[1:]))
    if ascending and all(t.is_cpu and t.is_contiguous() for t in caches) and kernel_available():
        torch.ops.dyspec.keep_slots(caches, slots, start)
        return
    idx = torch.tensor(slots, device=caches[0].device)
    for t in caches:
        t[..., start : start + len(slots), :] = t.index_select(-2, idx)


def row_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, H, d] over keys, values [Hkv, capacity, d]: row r attends to the cache slots
    slots[r, : counts[r]] (int64, in position order); query head h reads key head h // (H // Hkv).
    Returns [n, H, d]."""
    return torch.ops.dyspec.row_attention(q, keys, values, slots, counts, scale)


def visible_slots(mask: torch.Tensor | None, n: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots each of the last n of `end` tokens sees, in position order, [n, C] (C at least 2:
    a graph would specialize a size of 1), and their counts [n]: from a boolean mask [1, 1, n, >= end]
    (True where visible) or an additive one (0 where visible), or causally (None). One op of the
    kernel's library: a step's forwards each need them, and tensor ops would cost dozens of calls."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask == 0
    load()
    return torch.ops.dyspec.visible_slots(mask, n, end)


SCHEMA = "(Tensor q, Tensor keys, Tensor values, Tensor slots, Tensor counts, float scale) -> Tensor"
torch.library.define("dyspec::row_attention", SCHEMA)


@torch.library.register_fake("dyspec::row_attention")
def _(q, keys, values, slots, counts, scale):
    return q.new_empty(q.shape)
