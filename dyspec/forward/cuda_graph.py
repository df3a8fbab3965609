"""Lean forwards replayed as CUDA graphs (`--fast-path compiled` on a GPU), as gpt-fast and SGLang run
their decoding forwards.

Eager, a small model's forward on a GPU is bound by its kernel launches, not by reading its weights:
hundreds of small kernels, each launched from Python. A CUDA graph records a forward's kernels once
and replays them with one launch. A graph's shapes and addresses are fixed, so each model keeps one
LeanCache per role at a fixed capacity, every forward of a tree runs at one of the bucket sizes
(`dyspec.core.kv.BUCKETS`: the padding attends to itself alone and no token reads it), its mask spans
the whole cache, and the slots it writes come as a tensor (`run_layers`' `slots`), so nothing in the
graph depends on the cache's length. Before a replay the inputs are copied into the graph's own
tensors; after it its outputs are copied out (KVSession copies them), since the next replay
overwrites them.

Replayed, a graph still runs every kernel it recorded, each for a few microseconds at least: so its
layers are `lean.graph_layers`, one function per layer compiled by Inductor, whose elementwise ops
(norms, rotary, the softmax with its mask, the residual adds) fuse into a few kernels.

Graphs are recorded per bucket and input shapes on first use (`compile_forwards` records a
session's before its generation's clock starts): recording runs the forward eagerly twice on a side
stream (the layer function compiles on the first run, once per model shape, and Inductor keeps its
kernels on disk for later starts; cuBLAS and the allocator settle there), then once under capture.
Forwards longer than the largest bucket (a prompt) run eagerly over the same cache. On a CPU
`Graphs` calls the same forward over the same fixed tensors, its layers uncompiled, without
recording, so the logic around a graph is tested where no GPU is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dyspec.core.kv import BUCKETS, KVSession, Output, StaticModel
from dyspec.forward.lean import ROUND, LeanCache, new_cache
from dyspec.forward.static import compile_forwards


@dataclass
class Recorded:
    """One recorded forward: the tensors it reads and writes, and its graph (None on a CPU)."""

    inputs: dict[str, torch.Tensor]
    slots: torch.Tensor
    out: Output
    graph: torch.cuda.CUDAGraph | None


class Graphs:
    """`model`'s forward over `cache` as KVSession calls it, each bucket's forward recorded once and
    replayed. `model` is a lean forward (a target's LeanForward, or a feature draft in lean mode)
    whose forward takes `slots`."""

    def __init__(self, model: nn.Module, cache: LeanCache):
        self.model, self.cache = model, cache
        self.recorded: dict[tuple, Recorded] = {}
        self.positions = torch.arange(max(BUCKETS), device=cache.device)
        self.pool = torch.cuda.graph_pool_handle() if cache.device.type == "cuda" else None

    def __call__(self, input_ids, position_ids, attention_mask, logits_to_keep=0, output_hidden_states=False, **kw):
        tensors = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask}
        tensors |= {k: v for k, v in kw.items() if isinstance(v, torch.Tensor)}
        flags = {k: v for k, v in kw.items() if not isinstance(v, torch.Tensor) and k not in ("cache", "use_cache")}
        key = (output_hidden_states, *sorted((k, tuple(v.shape), v.dtype) for k, v in tensors.items()))
        key += tuple(sorted(flags.items()))
        start, n = self.cache.length, input_ids.shape[1]
        rec = self.recorded.get(key) or self._record(key, tensors, flags, output_hidden_states)
        for name, t in tensors.items():
            rec.inputs[name].copy_(t, non_blocking=True)
        torch.add(self.positions[:n], start, out=rec.slots)
        if rec.graph is not None:
            rec.graph.replay()
        else:
            rec.out = self._run(rec.inputs, rec.slots, flags, output_hidden_states)
        self.cache.length = start + n
        logits = rec.out.logits
        if isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        elif logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return Output(logits=logits, hidden_states=rec.out.hidden_states)

    def _run(self, inputs: dict, slots: torch.Tensor, flags: dict, hidden: bool) -> Output:
        """The forward over the recorded tensors; leaves the cache's length as it found it."""
        start = self.cache.length
        out = self.model(cache=self.cache, slots=slots, output_hidden_states=hidden, **inputs, **flags)
        self.cache.length = start
        return out

    def _record(self, key: tuple, tensors: dict, flags: dict, hidden: bool) -> Recorded:
        inputs = {name: t.clone() for name, t in tensors.items()}
        n = tensors["input_ids"].shape[1]
        slots = torch.add(self.positions[:n], self.cache.length)
        if self.pool is None:
            rec = self.recorded[key] = Recorded(inputs, slots, None, None)
            return rec
        side = torch.cuda.Stream(self.cache.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(inputs, slots, flags, hidden)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._run(inputs, slots, flags, hidden)
        rec = self.recorded[key] = Recorded(inputs, slots, out, graph)
        return rec


@dataclass
class GraphForward:
    """A lean forward on the graph path: per role a LeanCache at a fixed capacity (a multiple of
    ROUND, grown only between generations, which records its graphs anew) and its `Graphs`."""

    run: nn.Module
    held: dict[str, StaticModel] = field(default_factory=dict)

    def session(self, role: str, need: int, sizes=(), last_only=(False, True), **kwargs) -> KVSession:
        held = self.held.get(role)
        if held is None or held.capacity < need:
            capacity = -(-need // ROUND) * ROUND
            cache = new_cache(self.run, capacity, stacked=True)  # a graph takes one layer's tensors at a time
            held = self.held[role] = StaticModel(cache, capacity, Graphs(self.run, cache))
        held.cache.reset()
        kv = KVSession(self.run, static=held, bool_mask=True, **kwargs)
        compile_forwards(kv, sizes, last_only)
        return kv
