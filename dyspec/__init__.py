"""dyspec: interactive speculative decoding with token trees."""

from dyspec.core.engine import generate, stream
from dyspec.core.events import GenerationFinished, StepVerified, TreeExpanded
from dyspec.errors import DyspecError
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
