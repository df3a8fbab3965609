"""Batch-invariant attention for decoding forwards, used on the int8 path.

With int8 activations, a difference in the last bit of an activation can cross a rounding
boundary and grow into a visible change of the logits, so "a tree forward scores each node as a
single-token forward would" must hold bitwise, not just to 1e-6. Linear layers and norms already
compute each row on its own; attention does not (the kernels block differently for different query
counts and key lengths). Here each query attends through its own call over exactly the keys it sees
(the committed prefix and its ancestors, in position order), gathered into a contiguous tensor: the
same call, on the same shapes and values, that a one-token autoregressive step makes.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "dyspec_rowwise"
MAX_ROWS = 512  # longer inputs are prefills: plain SDPA (every policy shares the same prefill)


# (mask, per-row key indices): one mask object serves every layer of a forward. Holding the mask
# keeps its id from being reused by a later tensor, so an identity check is safe.
_seen_cache: tuple = (None, None)


def _seen(attention_mask: torch.Tensor | None, q_len: int, kv_len: int) -> list[torch.Tensor | None]:
    """Per query row, the indices of the keys it sees; None for all of them."""
    global _seen_cache
    if attention_mask is None:
        return [None if i == q_len - 1 else torch.arange(kv_len - q_len + i + 1) for i in range(q_len)]
    if _seen_cache[0] is not attention_mask:
        visible = attention_mask[0, 0] if attention_mask.dtype == torch.bool else attention_mask[0, 0] == 0
        rows = [visible[i].nonzero().squeeze(1) for i in range(q_len)]
        _seen_cache = (attention_mask, [None if len(r) == kv_len else r for r in rows])
    return _seen_cache[1]


def rowwise_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [1, H, q, d]; key, value [1, Hkv, kv, d]; attention_mask None (causal), additive
    [1, 1, q, kv] with 0 where visible, or boolean with True where visible. Returns [1, q, H, d]
    like HF's attention functions."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len > MAX_ROWS or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    rows = []
    for i, seen in enumerate(_seen(attention_mask, q_len, kv_len)):
        k, v = (key, value) if seen is None else (key.index_select(2, seen), value.index_select(2, seen))
        rows.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, i : i + 1], k, v, scale=scaling, enable_gqa=gqa
            )
        )
    return torch.cat(rows, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, rowwise_attention)
