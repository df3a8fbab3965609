"""dyspec: interactive speculative decoding with token trees."""

from dyspec.core.events import GenerationFinished, StepVerified, TreeExpanded
from dyspec.decode.engine import generate, stream
from dyspec.decode.replay import ReplayRun, Trace, record_trace, replay
from dyspec.errors import DyspecError
from dyspec.load import ModelPair, load_pair

__all__ = [
    "DyspecError",
    "GenerationFinished",
    "ModelPair",
    "ReplayRun",
    "StepVerified",
    "Trace",
    "TreeExpanded",
    "generate",
    "load_pair",
    "record_trace",
    "replay",
    "stream",
]
