"""Which forward and which cache run a model on a fast path: one place for the engine and the profile."""

from __future__ import annotations

from torch import nn

from dyspec.core.kv import KVSession
from dyspec.core.static import static_model
from dyspec.models.lean import runner


def open_session(model: nn.Module, fast_path: str, role: str, need: int, **kwargs) -> KVSession:
    """A session for `model` in `role` ("target", "draft0", ...: one model may be target and draft at
    once) on `fast_path`: a static cache holding `need` tokens (`static`, `compiled`), the lean
    forward's cache (`lean`, dyspec.models.lean), or a growing cache over the Hugging Face forward
    (`off`). `kwargs` go to KVSession."""
    if fast_path in ("static", "compiled"):
        kwargs["static"] = static_model(model, role, need, compiled=fast_path == "compiled")
    run = runner(model, fast_path)
    if run is not model:
        kwargs["cache"] = run.cache_for(role)
    return KVSession(run, **kwargs)
