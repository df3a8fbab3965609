"""Which forward runs a model, chosen once from the fast path (`choose_forward`), and the one place
that reads a fast path's name: the engine and the profile open sessions on a `Forward` and never ask
which one it is."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from dyspec.core.draft_model import draft_model
from dyspec.core.kv import KVSession
from dyspec.defaults import defaults_for
from dyspec.errors import DyspecError
from dyspec.forward import lean_graph
from dyspec.forward.cuda_graph import GraphForward
from dyspec.forward.lean import LeanForward, graph_layers_run, lean_unsupported
from dyspec.forward.quant import has_int8
from dyspec.forward.static import StaticForward
from dyspec.kernels.build import cpp_compiler

# "off": Hugging Face forwards over a growing cache; "lean": dyspec.forward.lean; "static" and
# "compiled": dyspec.forward.static (an int8 model compiled: dyspec.forward.lean_graph; a lean
# forward on a GPU replayed as CUDA graphs: dyspec.forward.cuda_graph)
FAST_PATHS = ("off", "lean", "static", "compiled")


class Forward(Protocol):
    def session(self, role: str, need: int, sizes=(), last_only=(False, True), **kwargs) -> KVSession:
        """A session of `role` ("target", "draft0", ...: one model may be target and draft at once)
        over an empty cache that holds `need` tokens where it is preallocated, ready to run forwards
        of `sizes` tokens (returning all rows' logits or, `last_only`, the last one's) without
        compiling during a generation; `kwargs` go to KVSession."""
        ...


@dataclass
class ModelForward:
    """The model's own forward over a growing cache (a cacheless draft: none), as it is."""

    model: nn.Module

    def session(self, role: str, need: int, sizes=(), last_only=(False, True), **kwargs) -> KVSession:
        return KVSession(self.model, **kwargs)


@dataclass
class LeanRun:
    """A lean forward (a target's `LeanForward`, or a feature draft's own lean layers) over its
    LeanCache per role, kept between generations; `compiled`: its layers compiled, on the first
    session (so that loading a pair, and a command that fails on its settings, compile nothing)."""

    run: nn.Module
    compiled: bool = False

    def session(self, role: str, need: int, sizes=(), last_only=(False, True), **kwargs) -> KVSession:
        if self.compiled:
            self.run.compile_layers()
        return KVSession(self.run, cache=self.run.cache_for(role), bool_mask=True, **kwargs)


def choose_forward(model: nn.Module, fast_path: str) -> Forward:
    """What runs `model`'s forwards on `fast_path`. On "lean" its lean forward where its architecture
    has one; on "compiled" an int8 model runs its lean forward compiled (torch.compile cannot trace
    int8 layers whole), a model on a GPU its lean forward replayed as CUDA graphs, and any other
    model the static path compiled. A feature draft runs its own small forward with its layers lean,
    on "lean", and on "compiled" in int8 with its layers compiled as a target's are, or on a GPU
    replayed as CUDA graphs. Else the model's own."""
    if fast_path not in FAST_PATHS:
        raise DyspecError(f"fast path must be one of {', '.join(FAST_PATHS)}, got '{fast_path}'")
    declared, int8 = draft_model(model), has_int8(model)
    if declared.cacheless or fast_path == "off":
        return ModelForward(model)
    if fast_path == "static":
        return StaticForward(model, compiled=False)
    graphs = fast_path == "compiled" and not int8 and model.device.type == "cuda"
    lean = declared.runs_lean or lean_unsupported(model) is None
    if not lean or not (fast_path == "lean" or int8 or graphs):
        return StaticForward(model, compiled=True) if fast_path == "compiled" and not int8 else ModelForward(model)
    if declared.runs_lean:
        model.use_lean()
    run = model if declared.runs_lean else LeanForward(model)
    return GraphForward(run) if graphs else LeanRun(run, compiled=fast_path == "compiled")


def layers_stamp(forward: Forward) -> dict[str, str]:
    """How a forward's layers run where one GPU may run them either way: a graph forward's compiled
    or not (`lean.graph_layers_run`); nothing for any other forward."""
    return {"graph_layers": graph_layers_run()} if isinstance(forward, GraphForward) else {}


def compiles_programs(fast_path: str) -> bool:
    """Whether the step on the device's programs run compiled (dyspec.core.programs) on `fast_path`:
    where the forward compiles."""
    return fast_path == "compiled"


def pick_fast_path(fast_path: str, device: torch.device, precision: str) -> str:
    """ "auto": the device's default (`dyspec.defaults`). "compiled" with int8 layers compiles the
    lean forward's layers (dyspec.forward.lean_graph). The CPU default, compiled, measured faster
    with int8 layers only, and compiling needs a C++ compiler and a PyTorch that keeps compiled
    graphs (`lean_graph.supported`): else "auto" runs the lean forward."""
    if fast_path not in ("auto", *FAST_PATHS):
        raise DyspecError(f"fast path must be one of auto, {', '.join(FAST_PATHS)}, got '{fast_path}'")
    if fast_path != "auto":
        return fast_path
    chosen = defaults_for(device).fast_path
    if device.type != "cpu" or chosen != "compiled":
        return chosen
    if precision != "int8":  # fp32 layers measured faster eager
        return "lean"
    why = compile_unavailable()
    if why:
        warnings.warn(f"{why}: the int8 forward runs eager (--fast-path lean), slower", stacklevel=3)
        return "lean"
    return chosen


def compile_unavailable() -> str | None:
    """Why the compiled int8 forward cannot run here, or None."""
    if not cpp_compiler():
        return "no C++ compiler found ($CXX, c++, g++ or clang++; install one for the compiled forward)"
    if not lean_graph.supported():
        return f"PyTorch {torch.__version__} cannot keep compiled graphs (2.13 can)"
    return None


def check_lean(fast_path: str, asked: str, model: nn.Module, int8: bool) -> str:
    """The fast path a target runs: "lean", and "compiled" with int8 layers, need an architecture
    the lean forward covers. Asked for by name, another one is an error; as the default, it runs
    the Hugging Face forward, with a note. Asked for by name on a GPU, "compiled" runs any other
    architecture on the static path compiled (`choose_forward`)."""
    graphs = fast_path == "compiled" and model.device.type == "cuda" and asked == "auto"
    why = lean_unsupported(model) if fast_path == "lean" or (fast_path == "compiled" and int8) or graphs else None
    if why is None:
        return fast_path
    if asked in ("lean", "compiled"):
        raise DyspecError(f"--fast-path {asked}: {why}")
    warnings.warn(f"{why}: the Hugging Face forward runs (--fast-path off)", stacklevel=3)
    return "off"
