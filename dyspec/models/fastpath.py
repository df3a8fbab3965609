"""Which forward and which cache run a model on a fast path: one place for the engine and the profile."""

from __future__ import annotations

from torch import nn

from dyspec.core.kv import KVSession
from dyspec.core.static import static_model
from dyspec.models.lean import is_lean, runner
from dyspec.models.quant import has_int8


def open_session(model: nn.Module, fast_path: str, role: str, need: int, **kwargs) -> KVSession:
    """A session for `model` in `role` ("target", "draft0", ...: one model may be target and draft at
    once) on `fast_path`: a static cache holding `need` tokens (`static`, `compiled`), the lean
    forward's cache (`lean`, and `compiled` for an int8 model: dyspec.models.lean_graph), or a
    growing cache over the Hugging Face forward (`off`); a model without a cache (`cacheless`)
    runs as it is. `kwargs` go to KVSession."""
    if getattr(model, "cacheless", False):
        return KVSession(model, **kwargs)
    run = runner(model, fast_path)
    if is_lean(run):
        kwargs["cache"] = run.cache_for(role)
    # torch.compile cannot trace int8 layers whole: on "compiled" an int8 model the lean forward does
    # not run runs eager
    elif fast_path == "static" or (fast_path == "compiled" and not has_int8(model)):
        kwargs["static"] = static_model(model, role, need, compiled=fast_path == "compiled")
    return KVSession(run, **kwargs)
