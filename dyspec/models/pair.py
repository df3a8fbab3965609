"""A target and its drafts, loaded together (`load_pair`), and what is named after them (`pair_key`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dyspec.core import attention
from dyspec.errors import DyspecError
from dyspec.models.draft_spec import DEFAULT_DRAFT, load_draft, parse_drafts
from dyspec.models.loading import (
    DEFAULT_TARGET,
    check_lean,
    load_model,
    load_tokenizer,
    pick_device,
    pick_dtype,
    pick_fast_path,
    pick_precision,
)
from dyspec.models.quant import quantize_int8


@dataclass
class ModelPair:
    target: PreTrainedModel
    draft: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase
    target_name: str
    draft_name: str | None
    device: torch.device
    dtype: torch.dtype
    precision: str = "native"  # "native" (bf16 on a GPU, fp32 on a CPU), "fp32", or "int8" (int8 Linear layers, CPU)
    extra_drafts: list[PreTrainedModel] = field(default_factory=list)  # merged by specinfer only
    extra_draft_names: list[str] = field(default_factory=list)
    # "off" (Hugging Face forwards, a growing cache), "lean" (dyspec.models.lean), "static" or "compiled"
    # (dyspec.core.static)
    fast_path: str = "off"

    @property
    def drafts_label(self) -> str | None:
        """Every draft's name, as given to `load_pair`."""
        return ",".join([self.draft_name, *self.extra_draft_names]) if self.draft_name else None

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end a generation, those Hugging Face's generate stops at: the generation
        config's EOS, which may be several (Llama 3 Instruct: <|end_of_text|> and <|eot_id|>) or not
        the tokenizer's (transformers 5.17 reads <|im_start|> as the default target's GGUF tokenizer's
        EOS), else the tokenizer's."""
        config = getattr(self.target.generation_config, "eos_token_id", None)
        ids = config if isinstance(config, list) else [self.tokenizer.eos_token_id if config is None else config]
        return frozenset(int(t) for t in ids if t is not None)

    @property
    def max_context(self) -> int:
        return int(getattr(self.target.config, "max_position_embeddings", 2048))


def pair_key(pair: ModelPair) -> str:
    """The file name stem of what is trained or measured for a target and draft (heads, acceptance)."""
    return f"{pair.target_name}--{pair.draft_name}".replace("/", "_").replace(":", "_")


def load_pair(
    target: str = DEFAULT_TARGET,
    draft: str | None = DEFAULT_DRAFT,
    device: str | None = None,
    device_map: str | None = None,
    allow_download: bool = False,
    precision: str = "auto",
    fast_path: str = "auto",
) -> ModelPair:
    """Load a target and a draft. `draft` is "auto" (`distilled` where one ships for the target;
    else int8 for an fp32 target on a CPU, else truncated:2), a model name as
    for the target, a folder made by `dyspec distill` (a feature draft), `distilled` (the feature
    draft shipped for the target), `eagle:PATH` (a published EAGLE-1/2 or EAGLE-3 draft, a folder or
    hub id: dyspec.models.eagle), `medusa:PATH` (published Medusa heads, likewise:
    dyspec.models.medusa), `truncated:N` (the target's first N layers, untrained), `int8`
    (the target with int8 Linear layers: a draft that needs no training, for a target that runs at
    native precision), `self` (the target itself, for testing), or None. Several drafts,
    comma-separated ("int8,distilled"), are merged into one tree by `specinfer`; every other policy
    drafts with the first.
    Hub ids load from the local cache unless `allow_download`. `precision` "auto" runs int8 Linear
    layers on a CPU (unless the draft is int8, which drafts for the fp32 target); outputs are then
    exact with respect to that int8 model. "fp32" gives the GGUF's fp32 weights as they are.
    `fast_path`: "auto" is the device's default (`dyspec.defaults`), "off" (Hugging Face forwards),
    "lean" (dyspec.models.lean), "static" or "compiled" (dyspec.core.static)."""
    dev = pick_device(device)
    specs = parse_drafts(draft, target, dev, precision)
    if any(spec.kind == "int8" for spec in specs):
        if precision == "int8":
            raise DyspecError(
                "the int8 draft is the target quantized and drafts for the fp32 target: use it with "
                "--precision fp32 (or auto), or --draft distilled with --precision int8"
            )
        if dev.type != "cpu":
            raise DyspecError("the int8 draft runs on a CPU only (fbgemm)")
        if precision == "auto":
            precision = "native"  # the fp32 target that the int8 draft drafts for
    precision = pick_precision(precision, dev)
    chosen = pick_fast_path(fast_path, dev, precision)  # a bad value fails before the models load
    dtype = torch.float32 if precision == "fp32" else pick_dtype(dev)
    tokenizer = load_tokenizer(target, allow_download)
    target_model = load_model(target, dev, dtype, device_map, allow_download)
    fast_path = check_lean(chosen, fast_path, target_model, precision == "int8")
    drafts = [load_draft(spec, target_model, tokenizer, allow_download) for spec in specs]
    for spec, model in zip(specs, drafts):
        if model.config.vocab_size != target_model.config.vocab_size:
            raise DyspecError(
                f"draft '{spec.name}' has {model.config.vocab_size} output logits, the target "
                f"{target_model.config.vocab_size}: they must be equal"
            )
    if len({d.feature_layers for d in drafts if getattr(d, "needs_features", False)}) > 1:
        raise DyspecError(f"the feature drafts in '{draft}' read different target layers: merge ones that agree")
    if precision == "int8":
        models = [m for m in (target_model, *drafts) if isinstance(m, PreTrainedModel)]
        for model in {id(m): m for m in models}.values():
            quantize_int8(model)
            model.set_attn_implementation(attention.NAME)
        for model in drafts:
            if hasattr(model, "quantize_int8"):  # a feature draft's or Medusa's own layers
                model.quantize_int8()
    return ModelPair(
        target_model,
        drafts[0] if drafts else None,
        tokenizer,
        target,
        specs[0].name if specs else None,
        dev,
        dtype,
        precision,
        extra_drafts=drafts[1:],
        extra_draft_names=[spec.name for spec in specs[1:]],
        fast_path=fast_path,
    )
