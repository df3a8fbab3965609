"""Published Medusa heads (Cai et al. 2024, FasterDecoding/Medusa's layout) as a draft,
`--draft medusa:PATH` with PATH a local folder or, with `--allow-download`, a hub id.

Medusa head k reads the target's final hidden state h_t (after its final norm) and proposes the
token at t + k + 2; the target's own output layer proposes t + 1:

    p_k( . | h_t) = softmax(W_k R_k(h_t)),    R_k = L residual blocks  x + SiLU(A x + b)

In a dyspec step the root is token t + 1 (the target sampled it) and the draft reads h_t, the
state before it, as a feature draft does. A head reads nothing of the tokens between t and the
position it proposes for, so every node at depth k below the root gets head k's distribution,
whatever its path: a tree policy grown by path probability (`dyspec`) builds Medusa's tree of top
tokens per head. The draft carries the depth in the feature it hands a node's children (h_t and
the children's depth), so a node needs no cache and no position. Past the last head it proposes
nothing: a uniform distribution, which no tree grown by probability expands into.

The checkpoint (`medusa_lm_head.safetensors` or `medusa_lm_head.pt`, and config.json with
`medusa_num_heads` and `medusa_num_layers`):

    {k}.{j}.linear.weight [H, H], {k}.{j}.linear.bias [H]   residual block j < L of head k
    {k}.{L}.weight [V, H]                                    head k's output layer
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from dyspec.core.kv import FINAL, Output
from dyspec.drafts.checkpoint import read_weights
from dyspec.errors import DyspecError
from dyspec.forward.quant import quantize_int8

PREFIX = "medusa:"
WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
KEY = re.compile(r"(\d+)\.(\d+)\.")


class ResBlock(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.linear = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaDraft(nn.Module):
    """Medusa's heads over `target`'s final hidden state, with the interface KVSession uses."""

    needs_features = True
    feature_layers = FINAL
    reads_first_token = True
    cacheless = True  # it attends to nothing: KVSession keeps no cache for it
    copy_weights = None
    runs_lean = False
    vocab = None  # its heads read out every token

    def __init__(self, target: PreTrainedModel, heads: int, layers: int):
        super().__init__()
        self.config = target.config
        H, V = target.config.hidden_size, target.config.vocab_size
        # the checkpoint's own names: head k is "k", its blocks "k.j", its output layer "k.L"
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResBlock(H) for _ in range(layers)), nn.Linear(H, V, bias=False)) for _ in range(heads)
        )
        # where and in what dtype it runs, kept apart from the heads' layers, which int8 replaces
        self.register_buffer("place", torch.zeros(0, dtype=target.dtype), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.place.device

    @property
    def dtype(self) -> torch.dtype:
        return self.place.dtype

    @property
    def feature_size(self) -> int:
        return self.config.hidden_size

    def quantize_int8(self) -> None:
        """The CPU fast path: every head's products in int8."""
        quantize_int8(self.heads)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        input_features: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **_,
    ) -> Output:
        """Logits [1, kept, V] after each input token and, as the last hidden state, what its children
        read: [h_t, their depth]. `input_features` [1, n, H] are the target's (a root's: head 0), or
        [1, n, H + 1] the draft's own (a tree node's: the head its depth names). Without them
        (latency profiling) the features are zeros."""
        H = self.config.hidden_size
        if input_features is None:
            input_features = torch.zeros(*input_ids.shape, H, device=self.device)
        h, depth = input_features[0, :, :H], torch.zeros(input_ids.shape[1], device=input_features.device)
        if input_features.shape[-1] > H:
            depth = input_features[0, :, H]
        children = torch.cat([h, (depth[:, None] + 1).to(h.dtype)], dim=-1)[None]
        if isinstance(logits_to_keep, torch.Tensor):
            h, depth = h[logits_to_keep], depth[logits_to_keep]
        elif logits_to_keep:
            h, depth = h[-logits_to_keep:], depth[-logits_to_keep:]
        logits = torch.zeros(len(h), self.config.vocab_size, device=h.device)  # uniform past the last head
        for k in depth.unique().long().tolist():
            if k < len(self.heads):
                rows = depth == k
                logits[rows] = self.heads[k](h[rows].to(self.dtype)).float()
        return Output(logits=logits[None], hidden_states=(children,))


def load_medusa(folder: Path, target: PreTrainedModel) -> MedusaDraft:
    """The Medusa heads in `folder`, for `target`, whose final hidden state they read."""
    tensors = read_weights(folder, WEIGHT_FILES, "Medusa")
    tensors = {k.removeprefix("medusa_head."): v for k, v in tensors.items()}
    indices = [tuple(map(int, m.groups())) for k in tensors if (m := KEY.match(k))]
    if not indices:
        raise DyspecError(f"{folder}: no Medusa head weights ({{k}}.{{j}}.*; keys: {', '.join(sorted(tensors))})")
    heads, layers = 1 + max(k for k, _ in indices), max(j for _, j in indices)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if (config.get("medusa_num_heads", heads), config.get("medusa_num_layers", layers)) != (heads, layers):
        raise DyspecError(
            f"{folder}: config.json says {config.get('medusa_num_heads')} heads of "
            f"{config.get('medusa_num_layers')} blocks; the weights hold {heads} of {layers}"
        )
    draft = MedusaDraft(target, heads, layers)
    try:
        draft.heads.load_state_dict({k: v.to(target.dtype) for k, v in tensors.items()})
    except RuntimeError as e:  # missing, unexpected or misshapen keys: torch names them after its first line
        details = " ".join(line.strip() for line in str(e).splitlines()[1:])
        raise DyspecError(
            f"the Medusa heads in {folder} do not fit this target (hidden size "
            f"{target.config.hidden_size}, {target.config.vocab_size} tokens): {details}"
        ) from None
    return draft.to(target.device).eval()
