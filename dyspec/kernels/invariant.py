"""Row-invariant kernels for the GPU forward, in Triton: each row of a forward computes exactly what
it computes in a forward of any other number of rows, so a token tree's row gives the logits of the
one-token forward of its path, bit for bit, in bf16 as in fp32 (DYSPEC_GPU_KERNELS=invariant).

The rule in every kernel: a row's arithmetic never depends on the other rows. Products run on one
tile over rows (BLOCK_M; rows past n are masked, never a smaller tile) with one reduction order
over K and no split-K; a norm reduces one row in one program; attention walks each row's own list
of visible cache slots in position order, in blocks of BLOCK_S with an online softmax, so a tree
row that sees the prefix and its ancestors sums exactly what the one-token forward over the
committed path sums. Triton's interpreter (`TRITON_INTERPRET=1`) runs them on a CPU for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
BLOCK_S = 64  # cache slots per block of attention


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 products in fp32, never rounded to tf32


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count, one row included
def _linear(
    x, w, b, y, M, N, K, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        wt = tl.load(w + cols[None, :] * K + ks[:, None], mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
        acc = tl.dot(a, wt, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y + rows[:, None] * N + cols[None, :], acc.to(y.dtype.element_ty), mask=(rows[:, None] < M) & (cols < N))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` (x [..., K] @ weight [N, K].T + bias), each row on the same tile whatever the row count."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = rows.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    b = bias if bias is not None else weight  # any pointer: HAS_BIAS keeps it unread
    _linear[grid](rows, weight.contiguous(), b, y, M, N, K, bias is not None, _precision(x), BLOCK_M, BLOCK_N, BLOCK_K)
    return y.view(*x.shape[:-1], N)


@triton.jit
def _rms_norm(x, w, y, N, eps, BLOCK: tl.constexpr):
    c = tl.arange(0, BLOCK)
    row = tl.program_id(0).to(tl.int64) * N
    xs = tl.load(x + row + c, mask=c < N, other=0.0).to(tl.float32)
    normed = xs * tl.rsqrt(tl.sum(xs * xs, 0) / N + eps)
    weight = tl.load(w + c, mask=c < N, other=0.0)
    tl.store(y + row + c, normed.to(y.dtype.element_ty) * weight, mask=c < N)  # as Hugging Face's RMSNorm


def rms_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`F.rms_norm` over the last dimension (`shape` is (its size,)), one row a program."""
    N = shape[-1]
    rows = x.reshape(-1, N).contiguous()
    y = torch.empty_like(rows)
    _rms_norm[(rows.shape[0],)](rows, weight, y, N, eps, triton.next_power_of_2(N))
    return y.view(x.shape)


@triton.jit
def _attention(
    q, keys, values, slots, counts, out, scale, capacity, width, HEADS: tl.constexpr, GROUP: tl.constexpr,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    r, h = tl.program_id(0), tl.program_id(1)  # a row, a key head and its group of query heads
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    heads = h * GROUP + g
    at = r * HEADS * D + heads[:, None] * D + d[None, :]
    rows = (g[:, None] < GROUP) & (d[None, :] < D)
    qs = tl.load(q + at, mask=rows, other=0.0)
    count = tl.load(counts + r)
    m = tl.full((BLOCK_G,), -float("inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for s0 in range(0, count, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        live = s < count
        slot = tl.load(slots + r * width + s, mask=live, other=0)
        kv = h * capacity * D + slot[:, None] * D + d[None, :]
        k = tl.load(keys + kv, mask=live[:, None] & (d[None, :] < D), other=0.0)
        v = tl.load(values + kv, mask=live[:, None] & (d[None, :] < D), other=0.0)
        scores = tl.where(live[None, :], tl.dot(qs, tl.trans(k), input_precision=PRECISION) * scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        shrink = tl.exp(m - m_new)
        total = total * shrink + tl.sum(p, 1)
        acc = acc * shrink[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    tl.store(out + at, (acc / total[:, None]).to(out.dtype.element_ty), mask=rows)


def visible_slots(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's visible cache slots in position order, then the rest, [n, capacity], and their
    counts [n], from a boolean [n, capacity]: no host read, shapes fixed by the mask's."""
    order = torch.sort((~visible).to(torch.uint8), dim=1, stable=True).indices
    return order, visible.sum(1)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: tuple, scale: float) -> torch.Tensor:
    """q [n, H, d] over keys, values [Hkv, capacity, d]: row r attends to its `seen` slots
    (`visible_slots`), query head h reads key head h // (H // Hkv). Returns [n, H * d]."""
    slots, counts = seen
    n, heads, d = q.shape
    kv_heads, capacity = keys.shape[:2]
    group = heads // kv_heads
    out = torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    block_g, block_d = (max(16, triton.next_power_of_2(x)) for x in (group, d))  # a product's least tile
    _attention[(n, kv_heads)](
        q.contiguous(), keys, values, slots, counts, out, scale, capacity, slots.shape[1],
        heads, group, d, block_g, block_d, BLOCK_S, _precision(q),
    )  # fmt: skip
    return out.view(n, heads * d)
