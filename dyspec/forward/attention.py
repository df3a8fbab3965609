"""Batch-invariant attention for decoding forwards, used on the int8 path.

With int8 activations, a difference in the last bit of an activation can cross a rounding
boundary and grow into a visible change of the logits, so "a tree forward scores each node as a
single-token forward would" must hold bitwise, not just to 1e-6. Linear layers and norms already
compute each row on its own; SDPA does not: its CPU kernel picks a different loop for different
query counts, key lengths, batch sizes and thread counts (tested: a row computed in a batch of 2
differs from the same row alone). So each query row attends over exactly the keys it sees (the
committed prefix and its ancestors, in position order), gathered and zero-padded to a multiple of
BLOCK keys, through batched matmuls and a softmax in which every row is its own batch entry or
reduction: a row's result depends on its own keys and padded length only, never on which rows
share the call. Rows are grouped by padded length, so a tree forward makes one or two calls per
layer (one SDPA call per row cost more than the tree saved).

Hugging Face builds no mask for an attention name it does not know, so a padded batch (batched
`generate`, as `dyspec.train.corpus.continuations` runs it) would attend to its padding: `padding_mask`
gives such a batch SDPA's mask.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "dyspec_rowwise"
BLOCK = 64

# (mask, shape, groups): one mask object (or None) and shape serve every layer of a forward.
# Holding the mask keeps its id from being reused by a later tensor, so an identity check is safe.
_groups_cache: tuple = (None, None, None)


def row_groups(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, kv_heads: int, device) -> list[tuple]:
    """Rows grouped by padded key count C: (rows [m] or None for all rows, key indices [m * C],
    bias [kv_heads * m, 1, C] with -inf on padding), on `device`."""
    global _groups_cache
    mask, shape, groups = _groups_cache
    if mask is attention_mask and shape == (q_len, kv_len, kv_heads, device):
        return groups
    order, counts = visible_order(attention_mask, q_len, kv_len)
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    groups = []
    for c in padded.unique().tolist():
        rows = (padded == c).nonzero().squeeze(1)
        cols = torch.arange(c)
        pad = cols[None] >= counts[rows, None]
        idx = order[rows][:, cols.clamp(max=kv_len - 1)].masked_fill(pad, 0)
        bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))[:, None].repeat(kv_heads, 1, 1)
        rows = None if len(rows) == q_len else rows.to(device)
        groups.append((rows, idx.flatten().to(device), bias.to(device)))
    _groups_cache = (attention_mask, (q_len, kv_len, kv_heads, device), groups)
    return groups


def visible_order(attention_mask: torch.Tensor | None, q_len: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the last q_len of kv_len tokens, the key positions it sees first, in position
    order, then the rest [q_len, kv_len], and how many it sees [q_len]: from a boolean mask [1, 1,
    q_len, kv_len] (True where visible) or an additive one (0 where visible), or causally (None)."""
    if attention_mask is None:
        visible = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    else:
        mask = attention_mask[0, 0].cpu()
        visible = mask if mask.dtype == torch.bool else mask == 0
    # visible keys first, in position order (a stable sort on "hidden"), then the rest
    return torch.sort((~visible).to(torch.uint8), dim=1, stable=True).indices, visible.sum(1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """m rows of g query heads per key head: q [Hkv, g, m, d] over their own keys k, v [Hkv * m, C, d]
    with bias [Hkv * m, 1, C]; returns [m, Hkv * g, d]. Every row is its own batch entry."""
    kv_heads, g, m, d = q.shape
    qr = q.transpose(1, 2).reshape(kv_heads * m, g, d)
    s = torch.baddbmm(bias.to(q.dtype), qr, k.transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(s, -1), v).view(kv_heads, m, g, d).transpose(0, 1).reshape(m, kv_heads * g, d)


def rowwise_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [1, H, q, d]; key, value [1, Hkv, kv, d]; attention_mask None (causal), additive
    [1, 1, q, kv] with 0 where visible, or boolean with True where visible. Returns [1, q, H, d]
    like HF's attention functions. A causal forward of several tokens over no cache is a prefill,
    which every policy makes the same way: plain SDPA. Over a cache (Hugging Face's assisted
    generation verifying its candidates) the rows go their own way: SDPA's `is_causal` aligns a
    short query block with the first keys, not the last."""
    n, kv_len = query.shape[2], key.shape[2]
    if query.shape[0] != 1 or (attention_mask is None and 1 < n == kv_len):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    heads, kv_heads, d = query.shape[1], key.shape[1], query.shape[3]
    q = query[0].view(kv_heads, heads // kv_heads, n, d)
    scale = d**-0.5 if scaling is None else scaling
    groups = row_groups(attention_mask, n, kv_len, kv_heads, key.device)
    return grouped_attention(q, key[0], value[0], groups, scale)[None], None


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, groups: list, scale: float):
    """q [Hkv, g, n, d] over keys, values [Hkv, kv, d], each group of rows (`row_groups`) over its own
    gathered keys: [n, Hkv * g, d]."""
    kv_heads, g, n, d = q.shape
    out = q.new_empty(n, kv_heads * g, d)
    for rows, idx, bias in groups:
        m, c = (n if rows is None else len(rows)), bias.shape[-1]
        k = keys.index_select(1, idx).view(kv_heads * m, c, d)
        v = values.index_select(1, idx).view(kv_heads * m, c, d)
        o = _attend(q if rows is None else q.index_select(2, rows), k, v, bias, scale)
        if rows is None:
            return o
        out[rows] = o
    return out


def prefix_bias(length: int, kv_heads: int, device) -> torch.Tensor:
    """The bias of one row that sees `length` keys, padded as `rowwise_attention` pads it: [Hkv, 1, C]."""
    c = -(-length // BLOCK) * BLOCK
    return torch.zeros(kv_heads, 1, c, device=device).index_fill_(2, torch.arange(length, c, device=device), -torch.inf)


def prefix_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float):
    """One query row [1, H, 1, d] that sees the first `length` slots of a preallocated cache keys,
    values [1, Hkv, capacity, d] (`bias` = `prefix_bias(length, ...)`): `rowwise_attention`'s
    result bit for bit, reading the cache in place instead of gathering its keys. The padding
    slots past `length` get weight 0, so what they hold (zeros or stale keys) does not count.
    Returns [1, H, d]."""
    kv_heads, c, d = keys.shape[1], bias.shape[-1], keys.shape[3]
    q = query[0].view(kv_heads, -1, 1, d)
    return _attend(q, keys[0, :, :c], values[0, :, :c], bias, scale)


def padding_mask(batch_size: int, *args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """SDPA's boolean mask [B, 1, q, kv] for inputs with padding; else None (causal), which every
    forward of one unpadded sequence gets, as before this mask was registered."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return sdpa_mask(batch_size, *args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(NAME, rowwise_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, padding_mask)
