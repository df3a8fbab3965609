"""A cheaper CPU forward: int8 Linear layers through fbgemm's dynamic quantized linear.

A decoding forward of a small model on a CPU is bound by reading weights (and fp32 GEMMs with a
few rows are inefficient); int8 weights read 4x fewer bytes and run on int8 dot-product units.

Exactness needs batch invariance: a tree forward must score each node as a single-token forward of
the same model would, or greedy speculative decoding stops matching greedy autoregressive decoding.
fbgemm picks one activation scale per call from the whole batch's range, which would make a token's
logits depend on its tree-mates. So each row is scaled to max |x| = 1 and a pinned row holding -1
and +1 fixes the batch range at [-1, 1]: every token is quantized exactly as it would be alone
(per-token scales), and the row scale is multiplied back after the (linear) layer.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
from torch import nn


@functools.cache
def int8_available() -> bool:
    """fbgemm's quantized ops are deprecated in PyTorch; where a build lacks them, precision "auto"
    falls back to native and "int8" says so."""
    try:
        Int8Linear(nn.Linear(8, 8, bias=False))(torch.zeros(1, 8))
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@functools.cache
def _has_vnni() -> bool:
    """Without VNNI, fbgemm's u8 x s8 products go through int16 sums that can saturate, so
    activations must use 7 bits (reduce_range); with VNNI the full 8 bits are safe."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and "vnni" in cpuinfo.read_text()


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = (w.abs().amax(dim=1).clamp_min(1e-12) / 127).double()
        zero = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # the qint8 tensor API is deprecated; see int8_available()
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = linear.bias
        pin = torch.zeros(1, self.in_features)
        pin[0, 0], pin[0, 1] = 1.0, -1.0
        self.register_buffer("pin", pin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        amax = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        packed_rows = torch.cat([rows / amax, self.pin])
        y = torch.ops.quantized.linear_dynamic(packed_rows, self._packed, not _has_vnni())[:-1] * amax
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y + self.bias if self.bias is not None else y


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of `model` (the output layer included) with an Int8Linear, in place."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child))
    return model
