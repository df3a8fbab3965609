"""Published EAGLE-1/2 drafts (SafeAILab/EAGLE's layout; HASS uses the same) as dyspec feature drafts,
`--draft eagle:PATH` with PATH a local folder or, with `--allow-download`, a hub id.

EAGLE's draft reads, with the embedding e_j of token j, the target's final hidden state f_{j-1}
(after its final norm) at the token before, and predicts f_j:

    x_j = W_fc [e_j; f_{j-1}] + b_fc
    h = decoder layers(x)      (Llama layers; the first has no input norm: x_j is its own scale)
    logits_j = target's output layer(h_j)      (no final norm)

and its first token is the prompt's second: the first has no state before it. That is
`FeatureDraft` with the fc's halves in the other order, a bias, the first input norm dropped, the
whole vocabulary, and the prompt's first token skipped (`reads_first_token`). The checkpoint:

    config.json          a Llama config: hidden_size, num_hidden_layers (the draft's), heads, vocab_size,
                         and "bias" (of fc; EAGLE reads a missing one as true)
    model.safetensors or pytorch_model.bin:
        fc.weight [H, 2H], fc.bias [H] (with bias)
        layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
        layers.{i}.input_layernorm.weight (i > 0; layer 0's is unused), layers.{i}.post_attention_layernorm.weight
        embed_tokens.weight (optional: a copy of the target's, which the draft borrows instead)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel

from dyspec.core.kv import FINAL
from dyspec.errors import DyspecError
from dyspec.models.feature_draft import FeatureDraft

PREFIX = "eagle:"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# what a draft's layers must share with the target to run beside it, as EAGLE's config names it
MATCHING = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "intermediate_size")


def eagle_folder(source: str, allow_download: bool) -> Path:
    """The local folder of an EAGLE checkpoint: `source` itself, or a hub id's snapshot (from the local
    Hugging Face cache unless `allow_download`)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise DyspecError(f"EAGLE checkpoint not found: {source} (a folder, or a hub id such as owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(source, local_files_only=not allow_download))
    except LocalEntryNotFoundError:
        raise DyspecError(
            f"EAGLE checkpoint {source} is not in the local Hugging Face cache: download it first "
            f"(`hf download {source}`) or allow downloads"
        ) from None


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            if name.endswith(".safetensors"):
                return load_file(folder / name)
            return torch.load(folder / name, map_location="cpu", weights_only=True)  # tensors only, never code
    raise DyspecError(f"{folder} holds no EAGLE weights (one of {', '.join(WEIGHT_FILES)})")


def load_eagle(folder: Path, target: PreTrainedModel) -> FeatureDraft:
    """The EAGLE-1/2 draft in `folder` as a feature draft of `target` (whose embedding and output
    layer it reads)."""
    if not (folder / "config.json").is_file():
        raise DyspecError(f"{folder} is not an EAGLE checkpoint (no config.json in it)")
    config = json.loads((folder / "config.json").read_text())
    wrong = [
        f"{key} {config.get(key)} (the target's: {getattr(target.config, key)})"
        for key in MATCHING
        if config.get(key, getattr(target.config, key)) != getattr(target.config, key)
    ]
    if wrong:
        raise DyspecError(f"the EAGLE draft in {folder} was trained for another target: {'; '.join(wrong)}")
    tensors = read_weights(folder)
    tensors.pop("embed_tokens.weight", None)
    tensors.pop("layers.0.input_layernorm.weight", None)  # stored, never read
    H, bias = target.config.hidden_size, config.get("bias", True)
    if "fc.weight" not in tensors:
        raise DyspecError(f"{folder}: no fc.weight, so not EAGLE-1/2's layout (keys: {', '.join(sorted(tensors))})")
    fc = tensors.pop("fc.weight")
    tensors["fc.weight"] = torch.cat([fc[:, H:], fc[:, :H]], dim=1)  # dyspec reads [feature; embedding]
    vocab = torch.arange(target.config.vocab_size)
    draft = FeatureDraft(target, vocab, FINAL, config.get("num_hidden_layers", 1), fc_bias=bias, first_norm=False)
    try:
        draft.load_state_dict({k: v.to(target.dtype) for k, v in tensors.items()})
    except RuntimeError as e:  # missing, unexpected or misshapen keys: torch names them after its first line
        details = " ".join(line.strip() for line in str(e).splitlines()[1:])
        raise DyspecError(f"the EAGLE checkpoint in {folder} does not fit this target: {details}") from None
    draft.reads_first_token = False
    return draft.to(target.device).eval()
