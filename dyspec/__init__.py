"""dyspec: interactive speculative decoding with token trees."""

from dyspec.engine import generate, stream
from dyspec.errors import DyspecError
from dyspec.events import GenerationFinished, StepVerified, TreeExpanded
from dyspec.models import ModelPair, load_pair

__all__ = [
    "DyspecError",
    "GenerationFinished",
    "ModelPair",
    "StepVerified",
    "TreeExpanded",
    "generate",
    "load_pair",
    "stream",
]
