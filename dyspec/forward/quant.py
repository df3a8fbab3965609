"""A cheaper CPU forward: int8 Linear layers through fbgemm's dynamic quantized linear.

A decoding forward of a small model on a CPU is bound by reading weights (and fp32 GEMMs with a
few rows are inefficient); int8 weights read a quarter of fp32's bytes and run on int8 dot-product units.

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

import torch
from torch import nn

from dyspec.kernels.build import cpu_flags


@functools.cache
def int8_available() -> bool:
    """fbgemm's quantized ops are deprecated in PyTorch; where a build lacks them, precision "auto"
    falls back to native and "int8" says so."""
    try:
        Int8Linear(torch.zeros(8, 8))(torch.zeros(1, 8))
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def _has_vnni() -> bool:
    """Without VNNI, fbgemm's u8 x s8 products go through int16 sums that can saturate, so
    activations must use 7 bits (reduce_range); with VNNI the full 8 bits are safe."""
    return any("vnni" in flag for flag in cpu_flags())


class Int8Linear(nn.Module):
    """x @ weight.T + bias with int8 weights and per-token int8 activations; weight [out, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        scale = (w.abs().amax(dim=1).clamp_min(1e-12) / 127).double()
        zero = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # the qint8 tensor API is deprecated; see int8_available()
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = bias
        self.reduce_range = not _has_vnni()
        # a plain attribute, not a buffer: fbgemm runs on the CPU only, and a buffer's lookup costs
        # microseconds on every call
        self.pin = torch.zeros(1, self.in_features)
        self.pin[0, 0], self.pin[0, 1] = 1.0, -1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # each op here costs microseconds, 121 calls a forward: reshape and cast only when needed
        rows = x if x.dim() == 2 and x.dtype == torch.float32 else x.reshape(-1, self.in_features).float()
        # abs().amax(): linalg.vector_norm(inf) is slower, the more so with more rows
        amax = rows.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)
        y = torch.ops.quantized.linear_dynamic(torch.cat([rows / amax, self.pin]), self._packed, self.reduce_range)
        y = y[:-1].mul_(amax)
        if rows is not x:
            y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return y + self.bias if self.bias is not None else y


def has_int8(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())


# Linear layers that read the same input in Llama-style blocks (Llama, Mistral, Qwen, SmolLM2, ...).
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedInputInt8(nn.Module):
    """Several Linear layers that read the same input, run as one Int8Linear: each call costs tens
    of microseconds beyond its arithmetic (quantizing the rows, fbgemm's set-up), and a one-token
    forward of the default target makes 211 of them. The result is bitwise that of the separate
    layers (per-token activation scales, per-channel weight scales, exact int32 sums). The first
    part called on an input computes every part; the others, called with the same tensor object (as
    the attention and MLP blocks do), slice that result."""

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        bias = None
        if linears[0].bias is not None:
            bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False)
        self.linear = Int8Linear(torch.cat([lin.weight.detach() for lin in linears]), bias)
        self.parts = len(linears)
        self._last: tuple = (None, None, 0)  # input, output, parts served

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last_x, y, served = self._last
        if last_x is not x:
            y, served = self.linear(x), 0
        # forget the input once every part has read it: no tensor outlives its layer's call
        self._last = (x, y, served + 1) if served + 1 < self.parts else (None, None, 0)
        return y


class Int8Part(nn.Module):
    """Output features [start, stop) of a SharedInputInt8."""

    def __init__(self, shared: SharedInputInt8, start: int, stop: int):
        super().__init__()
        self.shared, self.start, self.stop = shared, start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x)[..., self.start : self.stop]


class SplitInt8Linear(nn.Module):
    """x @ weight.T + bias for rows x = [a, b] whose parts differ widely in scale (a feature draft's
    [feature, embedding]): each part's product in int8 with its own per-row scale. One scale per
    row would leave the smaller part a few int8 levels."""

    # what it reads and returns: fbgemm's int8 layers run on the CPU, in fp32
    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self, linear: nn.Linear, split: int):
        super().__init__()
        weight = linear.weight.detach()
        self.split = split
        self.parts = nn.ModuleList(
            [Int8Linear(weight[:, :split].contiguous()), Int8Linear(weight[:, split:].contiguous(), linear.bias)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parts[0](x[..., : self.split]) + self.parts[1](x[..., self.split :])


def _fuse_shared_input(module: nn.Module) -> None:
    """Replace each group of SHARED_INPUT Linear children of `module` by Int8Parts of one
    SharedInputInt8, where the group's layers match in input size and in having a bias."""
    for names in SHARED_INPUT:
        linears = [getattr(module, name, None) for name in names]
        if not all(isinstance(lin, nn.Linear) for lin in linears):
            continue
        if len({(lin.in_features, lin.bias is None) for lin in linears}) > 1:
            continue
        shared, start = SharedInputInt8(linears), 0
        for name, lin in zip(names, linears):
            setattr(module, name, Int8Part(shared, start, start + lin.out_features))
            start += lin.out_features


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of `model` (the output layer included) with int8 layers, in place:
    those that read the same input (SHARED_INPUT) as one fused layer, the others one by one."""
    for module in list(model.modules()):
        _fuse_shared_input(module)
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child.weight, child.bias))
    return model
