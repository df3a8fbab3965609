"""The int8 lean forward compiled (`--fast-path compiled` on a CPU): its layers as a few graphs.

Eager, a one-token forward of the default target spends more time between its int8 products than in
them: ~600 small ops at microseconds each, and fbgemm's own set-up in each of its 121 calls. Here
blocks of BLOCK layers run as graphs compiled by inductor, which fuses the norms, rotary, residuals
and quantization into a few loops, with the products int8 x int8 -> int32 (dyspec.kernels.int8_mm).

Exactness needs a row's result to be the same whatever rows share the forward (dyspec.forward.quant),
and here it is by construction:
- activations are quantized per row: q = round(x * 127 / max|x|), each row alone;
- int32 sums are exact, so the product's kernel, its blocking and its row count do not matter;
- dequantizing, norms, rotary and the MLP's gate are per row and elementwise;
- attention is dyspec.kernels.row_attention's kernel: each row over its own keys, read in place.
tests/test_lean_graph.py checks tree rows against one-token forwards bit for bit. The compiled
forward runs other arithmetic than the eager int8 forward (its own activation quantization), so
its logits differ from eager's: it is its own int8 model, exact with itself.

A forward's final norm and output layer, over the rows it keeps, run as one graph too
(`output_rows`): eager, they are a dozen ops at the end of the forward, two of them passes over
every row's logits.

A feature draft's decoding forward runs as one graph from its input projection through its layers
to its output rows (`draft_block`): inside a step each op outside a graph costs far more than its
arithmetic, because the target's weights have just streamed through the caches.

A prompt (a causal forward over an empty cache) runs compiled too, as its own attention kind: its
rows attend through SDPA (every policy prefills alike, so its loop order is free) and its products
run oneDNN's `torch._int_mm` where that is fast at many rows (`int8_mm.ONEDNN_INT8`), dyspec's
kernel elsewhere. Only a forward of over MAX_ROWS tokens on a cache that
holds tokens runs eager. Graphs are compiled once per block shape and kind of forward (a prompt;
one row; a tree), with dynamic sizes: `warm_up` compiles them behind a progress bar; inductor keeps
its code on disk, so a later process mostly traces. A process keeps each graph once: a second model
of the same shapes (another pair's target) runs the first one's.

A block's graph is called without dynamo's guards (`torch.compile(...).aot_compile`): the forward
knows which graph a call needs (its kind and grad mode), and checking every input's guards (the
weights are inputs), reading their sizes and inductor's size asserts cost a noticeable share of a
one-token forward.
Tests run with CHECK_GUARDS, so every compiled forward of the suite checks that its graph's guards
hold. `aot_compile` bypasses torch.compile's disk caches, so each graph is saved whole in dyspec's
cache folder and a later process loads it, several times faster than torch.compile retracing
them from its caches.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes
from tqdm.auto import tqdm

from dyspec.cache import cache_dir
from dyspec.forward.quant import Int8Linear
from dyspec.kernels import row_attention
from dyspec.kernels.build import cpu_flags, source_bytes
from dyspec.kernels.int8_mm import SOURCE as INT8_MM_SOURCE
from dyspec.kernels.int8_mm import int8_mm, int8_operands

BLOCK = 5  # layers per graph: each graph call has a fixed cost, and a longer graph takes longer to trace
MAX_ROWS = 256  # longer forwards on a cache that holds tokens run eager
CHECK_GUARDS = False  # tests set it: each call checks its graph's guards, as torch.compile would
# every graph compiled or loaded in this process, by what it was compiled from: a second model of
# the same shapes (another pair's target) runs the first one's, as it would load them from disk
GRAPHS: dict[tuple, object] = {}


def linear_operands(linear: Int8Linear) -> tuple:
    """An Int8Linear's weights as `int8_linear` reads them: the int8 product's operands
    (dyspec.kernels.int8_mm), per-channel scales / 127, the bias, and the int8 weight transposed
    for `torch._int_mm` (a prompt's products, where oneDNN is fast)."""
    weight = torch.ops.quantized.linear_unpack(linear._packed)[0]
    packed, comp, plain = int8_operands(weight.int_repr())
    scale = weight.q_per_channel_scales().float() / 127
    return packed, comp, scale, linear.bias, plain


def int8_linear(x: torch.Tensor, operands: tuple, prompt: bool = False) -> torch.Tensor:
    """x [n, in] @ weight.T + bias, x quantized per row to int8. The int32 sums are exact, so the
    product's kernel does not change the result: a prompt's many rows may run oneDNN's
    `torch._int_mm` (`int8_mm`), a decoding forward's few rows run dyspec's kernel."""
    weight, comp, scale, bias, plain = operands
    amax = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    xq = torch.round(x * (127 / amax)).to(torch.int8)
    y = int8_mm(xq, weight, comp, plain, prompt).float() * amax * scale
    return y if bias is None else y + bias


def split_linear(a: torch.Tensor, b: torch.Tensor, first: tuple, second: tuple) -> torch.Tensor:
    """[a, b] [n, in] @ weight.T + bias with each part's rows quantized alone, on `linear_operands`
    of a SplitInt8Linear's parts."""
    return int8_linear(a, first) + int8_linear(b, second)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, d] at the rows' positions: x cos + rotate_half(x) sin, as Hugging Face does."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def layers_block(h, cos, sin, slots, keys, values, seen, layers, shape):
    """Layers of a Llama-family model over h [n, H]; writes each layer's keys and values [Hkv,
    capacity, d] at `slots`. `layers`: per layer (attn_norm, q_norm, k_norm, qkv, o, mlp_norm,
    gate_up, down) with linear_operands for the products; `seen` (row_attention.visible_slots): the
    cache slots each row sees and their counts, None for a prompt over an empty cache (causal over
    its own rows). Returns h and each layer's output."""
    heads, kv_heads, d, eps, scale = shape
    n = h.shape[0]
    prompt = seen is None  # a prompt over an empty cache: causal over its own rows
    outputs = []
    for (attn_norm, q_norm, k_norm, qkv, o, mlp_norm, gate_up, down), k_cache, v_cache in zip(layers, keys, values):
        x = F.rms_norm(h, h.shape[-1:], attn_norm, eps)
        y = int8_linear(x, qkv, prompt).view(n, heads + 2 * kv_heads, d)
        q, k, v = y[:, :heads], y[:, heads : heads + kv_heads], y[:, heads + kv_heads :]
        if q_norm is not None:
            q, k = F.rms_norm(q, (d,), q_norm, eps), F.rms_norm(k, (d,), k_norm, eps)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k_cache[:, slots] = k.transpose(0, 1)
        v_cache[:, slots] = v.transpose(0, 1)
        if prompt:  # every policy prefills alike: SDPA's kernel, whatever its loop order, is free to run
            q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
        else:
            a = row_attention.row_attention(q, k_cache, v_cache, *seen, scale)
        h = h + int8_linear(a.reshape(n, heads * d), o, prompt)
        x = F.rms_norm(h, h.shape[-1:], mlp_norm, eps)
        gate, up = int8_linear(x, gate_up, prompt).chunk(2, dim=-1)
        h = h + int8_linear(F.silu(gate) * up, down, prompt)
        outputs.append(h)
    return h, outputs


def draft_block(ids, features, embed, fc_feature, fc_embed, cos, sin, slots, keys, values, seen, layers, head, shape):
    """A feature draft's decoding forward (dyspec.drafts.feature) as one graph: each row's input
    [feature, its token's embedding] through `fc` (its two halves' int8 operands), the layers
    (`layers_block`), and the output rows of every row (a weight-bound product costs about as much
    for a few rows as for the one a root call keeps, and inside the graph it costs no call of its
    own). Returns the last layer's h and the logits."""
    x = split_linear(features, embed[ids], fc_feature, fc_embed)
    h, _ = layers_block(x, cos, sin, slots, keys, values, seen, layers, shape)
    return h, int8_linear(h, head)


def output_rows(h, norm, eps, head):
    """The final norm over h [n, H], and every row's logits through the int8 output layer."""
    h = F.rms_norm(h, h.shape[-1:], norm, eps)
    return h, int8_linear(h, head)


class CompiledLayers:
    """A lean forward's layers (dyspec.forward.lean.Layer, int8) as compiled blocks, and its output
    layer on the same int8 product."""

    def __init__(self, layers: list, dims: tuple, head: Int8Linear):
        """`dims`: dyspec.forward.lean.LeanDims."""
        self.head = linear_operands(head)
        self.shape = dims
        row_attention.load()
        weights = [
            (
                layer.attn_norm,
                layer.q_norm,
                layer.k_norm,
                *(linear_operands(lin) for lin in (layer.qkv, layer.o)),
                layer.mlp_norm,
                *(linear_operands(lin) for lin in (layer.gate_up, layer.down)),
            )
            for layer in layers
        ]
        self.layers = weights  # run BLOCK at a time
        self.graphs: dict = {}  # (function, kind, block length, modes) -> its compiled graph

    def forward(self, h, cos, sin, cache, start: int, mask: torch.Tensor | None) -> tuple[torch.Tensor, list]:
        """h [n, H] of tokens at cache slots start..start + n - 1, over the first `start` slots and
        themselves as `mask` says (None: causal); returns the last layer's h and every layer's."""
        kind, slots, seen = self.rows(h.shape[0], start, mask)
        outputs = []
        for i in range(0, len(self.layers), BLOCK):
            block = cache.k[i : i + BLOCK], cache.v[i : i + BLOCK], self.layers[i : i + BLOCK]
            args = (h, cos, sin, slots, *block[:2], seen, block[2], self.shape)
            h, hs = self.run(layers_block, kind, len(block[2]), args, (h, cos, sin, slots), seen)
            outputs += hs
        return h, outputs

    def draft(self, ids, features, inputs: tuple, cos, sin, cache, start: int, mask) -> tuple:
        """A feature draft's decoding forward (`draft_block`) of tokens `ids` [n] reading `features`
        [n, H], its `inputs` (the embedding's weight, and `fc`'s halves as `linear_operands`), at cache slots
        start..start + n - 1 as `forward` runs its layers (one block; `start` > 0): its last layer's
        h and every row's logits."""
        kind, slots, seen = self.rows(len(ids), start, mask)
        args = (ids, features, *inputs, cos, sin, slots, cache.k, cache.v, seen, self.layers, self.head, self.shape)
        return self.run(draft_block, f"draft-{kind}", len(self.layers), args, (ids, features, cos, sin, slots), seen)

    def rows(self, n: int, start: int, mask: torch.Tensor | None) -> tuple[str, torch.Tensor, tuple | None]:
        """A forward's kind ("prompt", "row", "tree"), the cache slots its rows write and the slots
        each row sees (row_attention.visible_slots; None for a prompt)."""
        slots = torch.arange(start, start + n)
        seen = None if start == 0 and n > 1 else row_attention.visible_slots(mask, n, start + n)
        return "prompt" if seen is None else "row" if n == 1 else "tree", slots, seen

    def run(self, fn, kind: str, layers: int, args: tuple, rows: tuple, seen):
        """`fn(*args)` through its graph, compiled on first use (`compile_graph`): a graph per
        function, kind, block length, grad mode and thread count (inductor parallelizes its loops
        for it), as torch.compile makes them."""
        key = fn, kind, layers, torch.is_inference_mode_enabled(), torch.is_grad_enabled(), torch.get_num_threads()
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = compile_graph(fn, kind, args, rows, seen)
        return graph(*args)

    def takes(self, n: int, start: int, mask: torch.Tensor | None) -> bool:
        """Whether a forward of n tokens after `start` cached ones runs compiled: a prompt over an
        empty cache (causal, no mask), or up to MAX_ROWS tokens on a cache that holds some."""
        return n <= MAX_ROWS if start else mask is None

    def output(self, h: torch.Tensor, norm: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The final norm's rows of a forward's last h [n, H] (the rows it keeps, n <= MAX_ROWS)
        and their logits (`output_rows`)."""
        return self.run(output_rows, "row" if len(h) == 1 else "tree", 0, (h, norm, eps, self.head), (h,), None)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output layer over the final norm's rows h [n, H], each row quantized alone, as the
        layers' products are."""
        return int8_linear(h, self.head, prompt=len(h) > MAX_ROWS)


def supported() -> bool:
    """Whether this PyTorch compiles and keeps graphs as `compile_graph` does (`aot_compile`,
    `torch.compiler.load_compiled_function`: 2.13 is the version tested)."""
    return hasattr(torch.compiler, "load_compiled_function")


def compile_graph(fn, kind: str, args: tuple, rows: tuple, seen):
    """`fn` (`layers_block`, `draft_block`) compiled for a kind of forward ("prompt", "row", "tree", a
    draft's "draft-row", "draft-tree") over `args`. Only the sizes marked here are dynamic (the first
    of `rows`' in forwards of several rows, and the slots a row sees, `seen`), each at least 2:
    weights keep static shapes, shared by every block, and a second model compiled in the process
    (a draft) gets graphs of its own shapes. Guards are checked only under CHECK_GUARDS."""
    one_row = kind.endswith("row")
    varying = [] if one_row else [(x, 0) for x in rows]
    if seen is not None:
        varying += [(seen[0], 1)] + ([] if one_row else [(seen[0], 0), (seen[1], 0)])
    for tensor, dim in varying:
        torch._dynamo.mark_dynamic(tensor, dim)
    path = saved_graph(kind, args)
    key = fn, path, CHECK_GUARDS
    if key not in GRAPHS:
        GRAPHS[key] = compiled_or_loaded(fn, args, path)
    return GRAPHS[key]


def compiled_or_loaded(fn, args: tuple, path: Path):
    """`fn`'s graph over `args`, loaded from `path` or compiled and saved there; under CHECK_GUARDS
    compiled afresh and unsaved: a loaded graph's guards misread the dynamic-size marks."""
    if CHECK_GUARDS:
        return torch.compile(fn, fullgraph=True, dynamic=False).aot_compile((args, {}))
    graph = load_graph(path)
    if graph is None:
        compiled = torch.compile(fn, fullgraph=True, dynamic=False, options={"size_asserts": False})
        graph = compiled.aot_compile((args, {}))
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        graph.save_compiled_function(str(tmp))
        tmp.replace(path)  # whole or not at all: processes share the folder
    graph.disable_guard_check()
    return graph


def load_graph(path: Path):
    """A block's graph an earlier process compiled (`aot_compile` bypasses torch.compile's disk
    caches, so a process would compile where loading is many times faster), or None."""
    try:
        with path.open("rb") as f:
            return torch.compiler.load_compiled_function(f)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 (a file this PyTorch cannot read: compiled anew)
        warnings.warn(f"a saved compiled graph did not load, compiling it again: {e}", stacklevel=2)
        return None


def saved_graph(kind: str, args: tuple) -> Path:
    """Where a block's compiled graph is kept: named by everything it was compiled from (this
    module and the kernels' sources, PyTorch and Python, the CPU's features (a cache folder may be
    shared by machines), the kind, grad mode, thread count, and every input's type, shape and
    dtype; dynamic sizes as the warm-up's)."""
    what = [Path(__file__).read_bytes(), *map(source_bytes, (row_attention.SOURCE, INT8_MM_SOURCE))]
    leaves = torch.utils._pytree.tree_leaves(args)
    inputs = [(type(x).__name__, tuple(x.shape), str(x.dtype)) if torch.is_tensor(x) else repr(x) for x in leaves]
    modes = kind, torch.is_inference_mode_enabled(), torch.is_grad_enabled(), torch.get_num_threads()
    flags = sorted(cpu_flags())
    what.append(repr((torch.__version__, sys.version, flags, modes, inputs)).encode())
    digest = hashlib.sha256(b"\0".join(what)).hexdigest()[:24]
    path = cache_dir() / "graphs" / f"{kind}-{digest}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def warm_up(lean, vocab: int) -> None:
    """Compile the graphs a generation uses (a prompt, one row, a tree) on a scratch cache, behind a
    progress bar."""
    cache = lean.cache_for("warm-up")
    shapes = [(60, 1, False), (60, 2, True)]  # (context, rows, tree)
    for context, n, tree in tqdm(shapes, desc="compiling the int8 forward (once per process)"):
        # as the engine runs it: a graph is compiled per grad mode, and with no dispatch mode around it
        # (a first generation's lazy warm-up may run under `dyspec.eval.anatomy`'s counter; a graph's
        # guards would then expect that mode's dispatch keys on every later call)
        with torch.inference_mode(), _disable_current_modes():
            warm_up_forward(lean, cache, vocab, context, n, tree)
    del lean._caches["warm-up"]


def warm_up_forward(lean, cache, vocab: int, context: int, n: int, tree: bool) -> None:
    cache.reset()
    lean(torch.randint(vocab, (1, context)), torch.arange(context)[None], cache=cache)
    mask = torch.ones(n, context + n, dtype=torch.bool).tril(context)[None, None] if tree else None
    lean(torch.randint(vocab, (1, n)), torch.arange(context, context + n)[None], mask, cache=cache)
