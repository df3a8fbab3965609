"""A lean forward for Llama-family models (`--fast-path lean`), in the style of gpt-fast's model.py.

On a CPU a one-token forward of a small target spends several times longer in the generic
modules around its matrix products than in them: separate q/k/v layers, rotary and norms as many
small ops, masks built per forward, a cache that grows, output-capture hooks. This forward runs the
same weights (the Hugging Face model's own modules, int8 or not) as a plain loop: q/k/v and
gate/up fused into one product each, one norm op, rotary from a table, and a preallocated KV cache
written in place. Attention is the Hugging Face path's own: `dyspec.forward.attention`'s batch-invariant
kernel on int8 models (bitwise what a one-token forward computes, which greedy exactness needs),
SDPA otherwise.

The Hugging Face forward stays the reference (`--fast-path off`, and every architecture not in
`ARCHITECTURES`): tests/test_lean.py compares their logits.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._triton import has_triton
from transformers import PreTrainedModel

from dyspec.core.kv import Output
from dyspec.errors import DyspecError
from dyspec.forward import lean_graph
from dyspec.forward.attention import prefix_attention, prefix_bias, rowwise_attention
from dyspec.forward.lean_graph import MAX_ROWS, CompiledLayers, warm_up
from dyspec.forward.quant import Int8Linear, Int8Part

# Llama's layer with optional q/k/v biases (Qwen2) and per-head q/k norms (Qwen3); full attention only.
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROUND = 1024  # cache capacities are multiples of it


def lean_unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot run the lean forward, or None if it can."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"{name} is not one of the lean forward's architectures ({', '.join(ARCHITECTURES)})"
    config = model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"{name} with sliding-window attention runs the Hugging Face forward"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in ("dynamic", "longrope"):  # their frequencies change with the sequence's length
        return f"{name} with {rope} rotary scaling runs the Hugging Face forward"
    return None


def fused_linear(linears: list[nn.Module]) -> nn.Module:
    """One layer for Linear layers that read the same input: the int8 path's fused layer itself
    (`quantize_int8` made one already), else one nn.Linear over their stacked weights."""
    if all(isinstance(lin, Int8Part) for lin in linears) and len({id(lin.shared) for lin in linears}) == 1:
        return linears[0].shared.linear
    if not all(isinstance(lin, nn.Linear) for lin in linears):
        raise TypeError(f"cannot fuse {[type(lin).__name__ for lin in linears]}")
    out_features = sum(lin.out_features for lin in linears)
    fused = nn.Linear(linears[0].in_features, out_features, bias=linears[0].bias is not None)
    fused = fused.to(linears[0].weight.device, linears[0].weight.dtype).requires_grad_(False)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([lin.bias for lin in linears]))
    # the separate layers now read slices of the fused weights: one copy in memory, not two
    start = 0
    for lin in linears:
        stop = start + lin.out_features
        lin.weight = nn.Parameter(fused.weight[start:stop], requires_grad=False)
        if fused.bias is not None:
            lin.bias = nn.Parameter(fused.bias[start:stop], requires_grad=False)
        start = stop
    return fused


@dataclass
class Layer:
    attn_norm: torch.Tensor | None  # None: no input norm (an EAGLE draft's first layer)
    qkv: nn.Module
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: nn.Module
    mlp_norm: torch.Tensor
    gate_up: nn.Module
    down: nn.Module


def lean_layers(decoder_layers) -> list[Layer]:
    """Hugging Face Llama-family decoder layers as the lean forward runs them."""
    return [
        Layer(
            getattr(layer.input_layernorm, "weight", None),
            fused_linear([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
            getattr(getattr(layer.self_attn, "q_norm", None), "weight", None),
            getattr(getattr(layer.self_attn, "k_norm", None), "weight", None),
            layer.self_attn.o_proj,
            layer.post_attention_layernorm.weight,
            fused_linear([layer.mlp.gate_proj, layer.mlp.up_proj]),
            layer.mlp.down_proj,
        )
        for layer in decoder_layers
    ]


class LeanDims(NamedTuple):
    """What the lean layers (`run_layers`, dyspec.forward.lean_graph) read besides their weights."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float  # the norms'
    scale: float  # attention's


def lean_dims(config) -> LeanDims:
    """A Llama-family config's LeanDims."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return LeanDims(heads, kv_heads, head_dim, config.rms_norm_eps, head_dim**-0.5)


def rotary_table(rotary: nn.Module, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [size, d] of positions 0 to size - 1, computed as Hugging Face's rotary module
    computes them."""
    positions = torch.arange(size, dtype=torch.float32, device=rotary.inv_freq.device)
    freqs = positions[:, None] * rotary.inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rotary.attention_scaling).to(dtype), (emb.sin() * rotary.attention_scaling).to(dtype)


def attend(q, keys, values, mask: torch.Tensor | None, start: int, end: int, dims: LeanDims, exact: bool, bias):
    """q [1, H, n, d] over the first `end` slots of the cache's keys, values [1, Hkv, capacity, d];
    returns [n, H, d]. `mask`: boolean [n, end] (True where visible), or additive [1, 1, n, width >=
    end] as KVSession sends it. `exact`: the batch-invariant attention (int8 models); `bias`:
    `prefix_bias` for a one-token forward on it."""
    n, scale = q.shape[2], dims.scale
    if bias is not None:
        return prefix_attention(q, keys, values, bias, scale)
    k, v = keys[:, :, :end], values[:, :, :end]
    if exact and mask is not None:
        return rowwise_attention(None, q, k, v, mask, scaling=scale)[0][0]
    if mask is None and n > 1 and start:  # causal over a cache that holds tokens already
        mask = torch.ones(n, end, dtype=torch.bool, device=q.device).tril(start)
    elif mask is not None:  # a static session's mask spans the whole cache
        mask = mask[..., :end] if mask.dtype == torch.bool else mask[0, 0, :, :end] == 0
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None and n > 1, scale=scale, enable_gqa=True
    )
    return o[0].transpose(0, 1)


def run_layers(
    layers: list[Layer], h, cos, sin, cache, start: int, mask, dims: LeanDims, exact: bool, hidden=None, slots=None
):
    """The layers over h [n, H] of tokens at cache slots start..start + n - 1 (rotary `cos`, `sin`
    [n, 1, d] at their positions), eager: writes their keys and values, returns the last layer's h
    and appends each layer's to `hidden` (a list) if given. `slots` [n] on the device instead of
    `start`: a forward replayed as a CUDA graph (`graph_layers`)."""
    if slots is not None:
        return graph_layers(layers, h, cos, sin, cache, mask, dims, hidden, slots)
    heads, kv_heads, d, eps, _ = dims
    n, end = h.shape[0], start + h.shape[0]
    # one row over the whole prefix (a step of `ar`, a chain's root) reads the cache in place
    bias = prefix_bias(end, kv_heads, h.device) if exact and n == 1 and mask is None else None
    # `.forward`, not the module's call: a call's hook checks cost microseconds, 150 times a forward
    for i, layer in enumerate(layers):
        x = h if layer.attn_norm is None else F.rms_norm(h, h.shape[-1:], layer.attn_norm, eps)
        qkv = layer.qkv.forward(x).view(n, heads + 2 * kv_heads, d)
        qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]
        if layer.q_norm is not None:
            q, k = F.rms_norm(qk[:, :heads], (d,), layer.q_norm, eps), qk[:, heads:]
            qk = torch.cat([q, F.rms_norm(k, (d,), layer.k_norm, eps)], dim=1)
        qk = lean_graph.rotate(qk, cos, sin)  # queries and keys in one go: the ops are elementwise
        q, k = qk[:, :heads], qk[:, heads:]
        keys, values = cache.layers[i].keys, cache.layers[i].values
        keys[0, :, start:end] = k.transpose(0, 1)
        values[0, :, start:end] = v.transpose(0, 1)
        o = attend(q.transpose(0, 1)[None], keys, values, mask, start, end, dims, exact, bias)
        h = h + layer.o.forward(o.reshape(n, heads * d))
        x = F.rms_norm(h, h.shape[-1:], layer.mlp_norm, eps)
        gate, up = layer.gate_up.forward(x).chunk(2, dim=-1)
        h = h + layer.down.forward(F.silu(gate) * up)
        if hidden is not None:
            hidden.append(h)
    return h


def graph_layers(layers: list[Layer], h, cos, sin, cache, mask, dims: LeanDims, hidden, slots):
    """The layers of a forward replayed as a CUDA graph (dyspec.forward.cuda_graph), over h [n, H]:
    writes keys and values at `slots` [n] and attends over the whole cache through `mask`, boolean
    [1, 1, n, capacity], so that no shape or index depends on the cache's length. On a GPU each
    layer runs `graph_layer` compiled (`compiled_graph_layer`): its elementwise ops fuse into a few
    kernels, and a graph of hundreds of small kernels costs what it launches, not what it reads.
    With the row-invariant kernels (`row_invariant_kernels`) it runs them instead, uncompiled."""
    kernels = row_invariant_kernels(h.device)
    if kernels is None:
        ops, step = TORCH_OPS, layer_function(h.device)
        seen = torch.zeros(mask.shape[-2:], dtype=torch.float32, device=h.device).masked_fill_(~mask[0, 0], -torch.inf)
        torch._dynamo.maybe_mark_dynamic(seen, 1)  # the cache's capacity, as LeanCache marks its keys
    else:
        ops, step, seen = kernels, graph_layer, kernels.visible_slots(mask[0, 0])
    for i, layer in enumerate(layers):
        args = (h, cos, sin, slots, cache.k[i], cache.v[i], seen, layer_weights(layer), dims, ops)
        try:
            h = step(*args)
        except torch._dynamo.exc.BackendCompilerFailed as e:  # before the layer ran: nothing was written
            step = uncompiled_after(e)
            h = step(*args)
        if hidden is not None:
            hidden.append(h)
    return h


def row_invariant_kernels(device: torch.device):
    """`dyspec.kernels.invariant` where DYSPEC_GPU_KERNELS=invariant asks for it, on a GPU (or a CPU
    under Triton's interpreter, TRITON_INTERPRET=1, for the tests): every row of a forward then
    computes what the one-row forward computes, so trees keep `ar`'s tokens in bf16. Else None."""
    if not invariant_asked():
        return None
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    if not has_triton() and device.type == "cuda":
        raise DyspecError("DYSPEC_GPU_KERNELS=invariant runs Triton kernels: pip install triton")
    from dyspec.kernels import invariant

    return invariant


def invariant_asked() -> bool:
    return os.environ.get("DYSPEC_GPU_KERNELS") == "invariant"


def layer_function(device: torch.device):
    """What runs a graph forward's layers: `graph_layer` compiled on a GPU; as it is on a CPU, where
    the graph path runs to be tested."""
    return compiled_graph_layer() if device.type == "cuda" else graph_layer


def layer_weights(layer: Layer) -> tuple:
    """A layer's tensors as `graph_layer` takes them: tensors, not modules, so that one compiled
    function serves every layer of the same shapes."""
    for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
        if type(lin) is not nn.Linear:
            raise TypeError(f"a graph forward runs nn.Linear layers, not {type(lin).__name__}")
    return (
        layer.attn_norm,
        layer.qkv.weight,
        layer.qkv.bias,
        layer.q_norm,
        layer.k_norm,
        layer.o.weight,
        layer.mlp_norm,
        layer.gate_up.weight,
        layer.down.weight,
    )


def stacked_attention(q, keys, values, bias, scale: float) -> torch.Tensor:
    """q [n, H, d] over keys, values [Hkv, capacity, d] with `bias` [n, capacity] (0 where visible,
    -inf elsewhere); returns [n, H * d]. Hugging Face's eager attention (scores in the model's dtype,
    softmax in fp32) with each key head's group of query heads stacked as rows of one product, so
    keys are read once, not repeated per head."""
    n, heads, d = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    q = q.reshape(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, group * n, d)
    scores = torch.bmm(q, keys.transpose(1, 2)).float().view(kv_heads, group, n, -1) * scale + bias
    p = torch.softmax(scores, dim=-1).to(values.dtype).view(kv_heads, group * n, -1)
    return torch.bmm(p, values).view(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, heads * d)


# a graph layer's products, norms and attention: PyTorch's, or dyspec.kernels.invariant's (the same names)
TORCH_OPS = SimpleNamespace(linear=F.linear, rms_norm=F.rms_norm, attention=stacked_attention)


def graph_layer(h, cos, sin, slots, keys, values, seen, weights: tuple, dims: LeanDims, ops=TORCH_OPS) -> torch.Tensor:
    """One Llama-family layer over h [n, H]: keys and values [Hkv, capacity, d] written at `slots`,
    attention over them as `seen` says: `stacked_attention`'s bias with TORCH_OPS, the rows'
    visible slots with the row-invariant kernels (`ops`)."""
    attn_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, mlp_norm, gate_up_w, down_w = weights
    heads, kv_heads, d, eps, scale = dims
    n = h.shape[0]
    x = h if attn_norm is None else ops.rms_norm(h, h.shape[-1:], attn_norm, eps)
    qkv = ops.linear(x, qkv_w, qkv_b).view(n, heads + 2 * kv_heads, d)
    qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]
    if q_norm is not None:
        q, k = ops.rms_norm(qk[:, :heads], (d,), q_norm, eps), ops.rms_norm(qk[:, heads:], (d,), k_norm, eps)
        qk = torch.cat([q, k], 1)
    qk = lean_graph.rotate(qk, cos, sin)
    keys.index_copy_(1, slots, qk[:, heads:].transpose(0, 1))
    values.index_copy_(1, slots, v.transpose(0, 1))
    h = h + ops.linear(ops.attention(qk[:, :heads], keys, values, seen, scale), o_w)
    x = ops.rms_norm(h, h.shape[-1:], mlp_norm, eps)
    gate, up = ops.linear(x, gate_up_w).chunk(2, dim=-1)
    return h + ops.linear(F.silu(gate) * up, down_w)


@functools.cache
def compiled_graph_layer():
    """`graph_layer` compiled once (Inductor), for every lean model and bucket: it compiles for one
    row, then once more for any number of rows (dynamic shapes), per model shape. The function
    itself, uncompiled, where Inductor cannot compile for a GPU (no Triton, or a compile that failed:
    `uncompiled_after`), with a note, or where `DYSPEC_GRAPH_LAYERS=eager` asks for it (to measure
    what compiling gains)."""
    if os.environ.get("DYSPEC_GRAPH_LAYERS") == "eager" or COMPILE_FAILED:
        return graph_layer
    if not has_triton():
        warnings.warn("Triton is not installed: the GPU forward's layers run uncompiled, slower", stacklevel=2)
        return graph_layer
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # Inductor says so when it splits the softmax's long reduction; nothing to act on here
    warnings.filterwarnings("ignore", message="Online softmax is disabled")
    return torch.compile(graph_layer, fullgraph=True)


COMPILE_FAILED: list[Exception] = []  # why compiling failed in this process, if it did


def uncompiled_after(error: Exception):
    """`graph_layer` as it is, from a failed compile on (Triton finding no C compiler, say), with a
    note: the generation goes on, slower."""
    COMPILE_FAILED.append(error)
    compiled_graph_layer.cache_clear()
    why = str(getattr(error, "inner_exception", None) or error).splitlines()[0][:200]
    warnings.warn(f"the GPU forward's layers did not compile ({why}): they run uncompiled, slower", stacklevel=3)
    return graph_layer


def graph_layers_run() -> str:
    """How a GPU forward's layers run: "invariant" (`row_invariant_kernels`), "compiled" or "eager"
    (`compiled_graph_layer`)."""
    if invariant_asked():
        return "invariant"
    return "eager" if compiled_graph_layer() is graph_layer else "compiled"


class LeanCache:
    """Keys and values of each layer, `k[i]` and `v[i]` [Hkv, capacity, d] (a tensor per layer, which a
    compiled graph writes in place), written in place; `length` slots hold tokens. Quacks like a
    Hugging Face cache where KVSession needs it: `layers[i].keys` and `.values` [1, Hkv, capacity,
    d] (views of them), `crop` and `reset`.

    `stacked`: every layer's keys views of one tensor [layers, Hkv, capacity, d], and its values of
    another (`stacked` holds the two), so that a commit moves a path's slots in all layers with a
    few ops, where a tensor per layer takes two a tensor (`KVSession.commit`). Only for forwards that
    hand a compiled graph one layer's tensors at a time (the graph path's): a graph given several
    views of one tensor, which it writes, must treat them as aliases."""

    def __init__(
        self, n_layers: int, kv_heads: int, head_dim: int, dtype, device, capacity: int = ROUND, stacked: bool = False
    ):
        self.shape, self.dtype, self.device = (n_layers, kv_heads, head_dim), dtype, device
        self.length = 0
        self._allocate(capacity, stacked)

    def _allocate(self, capacity: int, stacked: bool) -> None:
        n_layers, kv_heads, head_dim = self.shape
        held = getattr(self, "k", []) + getattr(self, "v", [])  # growing: keep what is held
        shape = (kv_heads, capacity, head_dim)
        # never inference tensors, whatever mode allocates them: a compiled graph is made for one kind
        with torch.inference_mode(False), torch.no_grad():
            zeros = functools.partial(torch.zeros, dtype=self.dtype, device=self.device)
            if stacked:
                self.stacked = zeros(n_layers, *shape), zeros(n_layers, *shape)
                self.k, self.v = (list(t.unbind()) for t in self.stacked)
            else:
                self.stacked = None
                self.k, self.v = ([zeros(shape) for _ in range(n_layers)] for _ in "kv")
            for new, old in zip(self.k + self.v, held):
                new[:, : self.length] = old[:, : self.length]
            for t in self.k + self.v:
                torch._dynamo.mark_dynamic(t, 1)  # a compiled forward (lean_graph) serves every capacity
        self.layers = [SimpleNamespace(keys=k[None], values=v[None]) for k, v in zip(self.k, self.v)]
        self.capacity = capacity

    def reserve(self, n: int) -> None:
        if self.length + n > self.capacity:
            self._allocate(-(-(self.length + n) // ROUND) * ROUND, self.stacked is not None)

    def crop(self, tokens_to_remove: int) -> None:
        self.length -= abs(tokens_to_remove)

    def reset(self) -> None:
        self.length = 0


class LeanForward(nn.Module):
    """The forward of a Llama-family causal LM over a `LeanCache`, with the interface KVSession
    uses (`input_ids`, `position_ids`, an additive or boolean `attention_mask` over the cached
    slots and new tokens, `cache`, `logits_to_keep`, `output_hidden_states`). Shares the model's
    weights. `exact_attention` (int8 models) runs the batch-invariant attention."""

    def __init__(self, model: PreTrainedModel):
        super().__init__()
        if why := lean_unsupported(model):
            raise ValueError(why)
        self.model, config = model, model.config
        self.config, self.generation_config = config, model.generation_config
        self.dims = lean_dims(config)
        base = model.model
        self.embed = base.embed_tokens
        self.norm = base.norm.weight
        self.lm_head = model.lm_head
        self.layers = lean_layers(base.layers)
        self.exact_attention = isinstance(self.lm_head, Int8Linear)  # quantize_int8 converts every Linear
        self.rotary = base.rotary_emb
        self.cos, self.sin = rotary_table(self.rotary, config.max_position_embeddings, self.dtype)
        self._caches: dict[str, LeanCache] = {}
        self.graph: CompiledLayers | None = None  # `compile_layers`

    def compile_layers(self) -> None:
        """Run the layers of a decoding forward as compiled graphs (dyspec.forward.lean_graph; int8
        models), compiled now; once."""
        if not self.exact_attention:
            raise ValueError("the compiled lean forward runs int8 models")
        if not lean_graph.supported():
            why = f"the compiled int8 forward needs a newer PyTorch than {torch.__version__}"
            raise DyspecError(f"{why}: use --fast-path lean")
        if self.graph is None:
            self.graph = CompiledLayers(self.layers, self.dims, self.lm_head)
            warm_up(self, self.config.vocab_size)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def cache_for(self, role: str) -> LeanCache:
        return role_cache(self, role)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: LeanCache | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool = False,
        slots: torch.Tensor | None = None,
        **_,
    ) -> Output:
        """`slots`: run_layers'."""
        n, mask = input_ids.shape[1], attention_mask
        start = cache.length
        cache.reserve(n)
        end = start + n
        cos, sin = rotary_rows(self, position_ids, end)
        h = self.embed(input_ids[0])
        hidden = [h] if output_hidden_states else None
        if self.graph is not None and self.graph.takes(n, start, mask):
            h, outputs = self.graph.forward(h, cos, sin, cache, start, mask)
            if hidden is not None:
                hidden += outputs
        else:
            h = run_layers(self.layers, h, cos, sin, cache, start, mask, self.dims, self.exact_attention, hidden, slots)
        kernels = None if slots is None else row_invariant_kernels(h.device)
        return self._output(h, cache, end, hidden, logits_to_keep, kernels)

    def _output(self, h, cache: LeanCache, end: int, hidden: list | None, logits_to_keep, kernels=None) -> Output:
        """The forward's result from the last layer's h: the final norm, the kept rows' logits. The
        norm is per row, so the kept rows are taken before it; compiled, their norm and logits run
        as one graph, whichever rows a forward keeps (so every logit comes from the same code);
        with the row-invariant `kernels`, those."""
        cache.length = end
        kept = h
        if isinstance(logits_to_keep, torch.Tensor):
            kept = h[logits_to_keep]
        elif logits_to_keep:
            kept = h[-logits_to_keep:]
        if kernels is not None:
            normed = kernels.rms_norm(kept, kept.shape[-1:], self.norm, self.dims.eps)
            logits = kernels.linear(normed, self.lm_head.weight, self.lm_head.bias)
        elif self.graph is not None and len(kept) <= MAX_ROWS:
            normed, logits = self.graph.output(kept, self.norm, self.dims.eps)
        else:
            normed = F.rms_norm(kept, kept.shape[-1:], self.norm, self.dims.eps)
            logits = self.graph.logits(normed) if self.graph is not None else self.lm_head.forward(normed)
        if hidden is not None:  # the last hidden state is the normed one, as Hugging Face returns it
            hidden[-1] = normed if kept is h else F.rms_norm(h, h.shape[-1:], self.norm, self.dims.eps)
        hidden_states = BatchOfOne(hidden) if hidden is not None else None
        return Output(logits=logits[None], hidden_states=hidden_states)


class BatchOfOne(Sequence):
    """Each layer's hidden states [n, H] as Hugging Face returns them, [1, n, H], each made when read:
    a session reads one or a few of a forward's dozens."""

    def __init__(self, rows: list[torch.Tensor]):
        self.rows = rows

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i][None]

    def __len__(self) -> int:
        return len(self.rows)


def role_cache(model: nn.Module, role: str) -> LeanCache:
    """`model.cache_for(role)`: the cache of `role` ("target", "draft0", ...: one model may be target
    and draft at once) in `model._caches`, emptied: kept between generations, so that a generation
    does not allocate its cache anew."""
    cache = model._caches.get(role)
    if cache is None:
        cache = model._caches[role] = new_cache(model)
    cache.reset()
    return cache


def new_cache(model: nn.Module, capacity: int = ROUND, stacked: bool = False) -> LeanCache:
    """An empty LeanCache of `capacity` slots for a lean model's layers (a LeanForward, or a feature
    draft in lean mode: `layers` and `dims`)."""
    dims = model.dims
    return LeanCache(len(model.layers), dims.kv_heads, dims.head_dim, model.dtype, model.device, capacity, stacked)


def rotary_rows(model: nn.Module, position_ids: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, 1, d] at `position_ids` [1, n] from `model.cos` and `.sin`, grown to cover
    `end` slots first (a position is never past its slot)."""
    if end > len(model.cos):
        model.cos, model.sin = rotary_table(model.rotary, 2 * end, model.cos.dtype)
    return model.cos[position_ids[0], None], model.sin[position_ids[0], None]
