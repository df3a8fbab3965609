"""Drafts as users name them (`--draft`), parsed once into a `DraftSpec`, and loaded.

auto           distilled where a feature draft ships for the target; else int8 for an fp32
               target on a CPU; else truncated:2
distilled      the feature draft shipped for the target (made by `dyspec distill`)
FOLDER         a feature draft's folder (made by `dyspec distill`), or a model folder
eagle:PATH     a published EAGLE-1/2 (or HASS) or EAGLE-3 draft: a folder, or a hub id (dyspec.drafts.eagle)
medusa:PATH    published Medusa heads: a folder, or a hub id (dyspec.drafts.medusa)
int8           the target with int8 Linear layers: a draft that needs no training
truncated:N    the target's first N layers with its final norm and output layer, untrained
self           the target itself (for testing)
NAME           a hub id, local folder or .gguf file, as for the target (same tokenizer)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dyspec.cache import SHIPPED
from dyspec.drafts.checkpoint import checkpoint_folder
from dyspec.drafts.eagle import PREFIX as EAGLE
from dyspec.drafts.eagle import load_eagle
from dyspec.drafts.feature import is_feature_draft, load_feature_draft
from dyspec.drafts.medusa import PREFIX as MEDUSA
from dyspec.drafts.medusa import load_medusa
from dyspec.errors import DyspecError
from dyspec.forward.quant import int8_available, quantize_int8
from dyspec.load.loading import load_model, load_tokenizer, truncated_copy

DEFAULT_DRAFT = "auto"
STANDIN_DRAFT = "truncated:2"  # accepted rarely: where neither a shipped draft nor int8 applies
SHIPPED_DRAFTS = SHIPPED / "drafts"  # feature drafts made by `dyspec distill`, per target


@dataclass(frozen=True)
class DraftSpec:
    """One draft, parsed: `kind` "self", "int8", "feature" (from `folder`), "eagle" or "medusa" (from
    `source`, a folder or hub id), "truncated" (the target's first `layers` layers) or "model" (loaded by
    `name`, as a target is)."""

    name: str  # as given, after "auto" is resolved
    kind: str
    folder: Path | None = None
    layers: int = 0
    source: str = ""


def shipped_draft(target: str) -> Path | None:
    """The folder of the feature draft shipped for `target` (a name like the default's, not a path or
    hub id), or None."""
    folder = SHIPPED_DRAFTS / target
    return folder if Path(target).name == target and is_feature_draft(folder) else None


def auto_draft(target: str, device: torch.device, precision: str) -> str:
    """What "auto" names for `target` at `precision` on `device`."""
    if shipped_draft(target):
        return "distilled"
    if device.type == "cpu" and precision in ("fp32", "native") and int8_available():
        return "int8"
    return STANDIN_DRAFT


def parse_draft(name: str, target: str) -> DraftSpec:
    """The draft `name` names for `target` ("auto" resolved already)."""
    if name in ("self", "int8"):
        return DraftSpec(name, name)
    if name == "distilled":
        if (folder := shipped_draft(target)) is None:
            raise DyspecError(f"no distilled draft ships for target '{target}': make one with `dyspec distill`")
        return DraftSpec(name, "feature", folder)
    if Path(name).is_dir() and is_feature_draft(Path(name)):
        return DraftSpec(name, "feature", Path(name))
    for prefix in (EAGLE, MEDUSA):
        if name.startswith(prefix):
            return DraftSpec(name, prefix[:-1], source=name[len(prefix) :])
    if name.startswith("truncated:"):
        try:
            return DraftSpec(name, "truncated", layers=int(name.split(":", 1)[1]))
        except ValueError:
            raise DyspecError(f"bad draft '{name}': use truncated:N with N a number of layers") from None
    return DraftSpec(name, "model")


def feature_folder(name: str, target: str, what: str) -> Path:
    """The folder of the feature draft `name` names for `target` (a folder made by `dyspec distill`,
    or distilled); `what` says which argument named it, in the error."""
    spec = parse_draft(name, target)
    if spec.kind != "feature":
        raise DyspecError(f"{what} must be a folder made by `dyspec distill`, or distilled; got '{name}'")
    return spec.folder


def parse_drafts(text: str | None, target: str, device: torch.device, precision: str) -> list[DraftSpec]:
    """The drafts of a comma-separated list ("int8,distilled"; None: no draft), "auto" resolved for
    `target` at `precision` (as asked, before "auto" is picked) on `device`."""
    names = [] if text is None else [n.strip() for n in text.split(",")]
    if "" in names:
        raise DyspecError(f"bad draft list '{text}': names separated by single commas")
    return [parse_draft(auto_draft(target, device, precision) if n == "auto" else n, target) for n in names]


def load_draft(
    spec: DraftSpec, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, allow_download: bool
) -> PreTrainedModel:
    """The draft `spec` names, for `target` (on its device and dtype)."""
    if spec.kind == "self":
        return target
    if spec.kind == "int8":
        return quantize_int8(truncated_copy(target, target.config.num_hidden_layers))
    if spec.kind == "feature":
        return load_feature_draft(spec.folder, target)
    if spec.kind == "eagle":
        return load_eagle(checkpoint_folder(spec.source, allow_download, "EAGLE"), target)
    if spec.kind == "medusa":
        return load_medusa(checkpoint_folder(spec.source, allow_download, "Medusa"), target)
    if spec.kind == "truncated":
        return truncated_copy(target, spec.layers)
    check_same_vocab(tokenizer, load_tokenizer(spec.name, allow_download), spec.name)
    return load_model(spec.name, target.device, target.dtype, allow_download=allow_download)


def check_same_vocab(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase, draft_name: str) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise DyspecError(
            f"draft '{draft_name}' has a different vocabulary from the target "
            f"({len(draft_tok)} vs {len(target_tok)} tokens): target and draft must share a tokenizer"
        )
