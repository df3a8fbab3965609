"""Published draft checkpoints (EAGLE's, Medusa's): a folder or a hub id, and the tensors in it."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from dyspec.errors import DyspecError


def checkpoint_folder(source: str, allow_download: bool, kind: str) -> Path:
    """The local folder of a `kind` ("EAGLE", "Medusa") checkpoint: `source` itself, or a hub id's
    snapshot (from the local Hugging Face cache unless `allow_download`)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise DyspecError(f"{kind} checkpoint not found: {source} (a folder, or a hub id such as owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(source, local_files_only=not allow_download))
    except LocalEntryNotFoundError:
        raise DyspecError(
            f"{kind} checkpoint {source} is not in the local Hugging Face cache: download it first "
            f"(`hf download {source}`) or allow downloads"
        ) from None


def read_weights(folder: Path, names: tuple[str, ...], kind: str) -> dict[str, torch.Tensor]:
    """The tensors of the first of `names` in `folder`: safetensors, or a pickle read as tensors only."""
    for name in names:
        if (folder / name).is_file():
            if name.endswith(".safetensors"):
                return load_file(folder / name)
            return torch.load(folder / name, map_location="cpu", weights_only=True)  # tensors only, never code
    raise DyspecError(f"{folder} holds no {kind} weights (one of {', '.join(names)})")
