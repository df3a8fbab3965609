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
key head read its keys, then its values, together. C++ with GCC's and Clang's vector extensions
(every sum in the order written): it builds wherever torch.compile does, which the compiled
forward needs anyway.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from dyspec.forward.attention import visible_order
from dyspec.kernels.build import build

SOURCE = Path(__file__).with_suffix(".cpp")


@functools.cache
def load() -> None:
    """Build the kernel (once per machine) and load it."""
    torch.ops.load_library(str(build(SOURCE, ["-march=native"])))


def row_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, H, d] over keys, values [Hkv, capacity, d]: row r attends to the cache slots
    slots[r, : counts[r]] (int64, in position order); query head h reads key head h // (H // Hkv).
    Returns [n, H, d]."""
    return torch.ops.dyspec.row_attention(q, keys, values, slots, counts, scale)


def visible_slots(mask: torch.Tensor | None, n: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots each of the last n of `end` tokens sees, in position order, [n, C] (C at least 2:
    a graph would specialize a size of 1), and their counts [n]: from a mask as
    `dyspec.forward.attention.visible_order` reads it."""
    if n == 1:  # one row (ar's, a draft node's): its slots straight from its mask's row, no sort
        row = None if mask is None else mask[0, 0, 0, :end].cpu()
        seen = torch.arange(end) if row is None else (row if row.dtype == torch.bool else row == 0).nonzero()[:, 0]
        slots = seen[None]  # contiguous [1, C]: no copy where it sees two slots or more
        if len(seen) < 2:
            slots = torch.zeros(1, 2, dtype=torch.long)
            slots[0, : len(seen)] = seen
        return slots, torch.tensor([len(seen)])
    order, counts = visible_order(mask, n, end)
    c = max(2, int(counts.max()))
    slots = order.new_zeros(n, c)  # strides (c, 1) even for one row: a graph's guards check them
    slots[:, : min(c, end)] = order[:, :c]
    return slots, counts


SCHEMA = "(Tensor q, Tensor keys, Tensor values, Tensor slots, Tensor counts, float scale) -> Tensor"
torch.library.define("dyspec::row_attention", SCHEMA)


@torch.library.register_fake("dyspec::row_attention")
def _(q, keys, values, slots, counts, scale):
    return q.new_empty(q.shape)
