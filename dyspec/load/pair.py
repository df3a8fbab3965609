"""A target and its drafts, loaded together (`load_pair`), and what is named after them (`pair_key`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dyspec.core.draft_model import draft_model
from dyspec.errors import DyspecError
from dyspec.forward import attention
from dyspec.forward.choose import Forward, check_lean, choose_forward, pick_fast_path
from dyspec.forward.quant import quantize_int8
from dyspec.forward.thread import forward_thread
from dyspec.kernels.int8_mm import kernel_path
from dyspec.load.draft_spec import DEFAULT_DRAFT, load_draft, parse_drafts
from dyspec.load.loading import DEFAULT_TARGET, load_model, load_tokenizer, pick_device, pick_dtype, pick_precision


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
    fast_path: str = "off"  # one of dyspec.forward.choose.FAST_PATHS
    # (fast path, model id) -> the Forward that runs it: its caches and compiled graphs, kept between
    # generations and shared by a copy of the pair (`dataclasses.replace`)
    forwards: dict = field(default_factory=dict, repr=False, compare=False)
    # what policies learn and keep across the pair's generations (Token Recycling's table), by
    # policy; `memo.clear()` forgets it, so that a seeded generation repeats exactly
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def forward(self, model: nn.Module) -> Forward:
        """What runs `model` (the target or a draft) on the pair's fast path, chosen once."""
        key = (self.fast_path, id(model))  # the Forward holds the model, so its id stays its own
        if key not in self.forwards:
            self.forwards[key] = choose_forward(model, self.fast_path)
        return self.forwards[key]

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
    def int8_kernel(self) -> str | None:
        """The path a CPU int8 pair's products run on (dyspec.kernels.int8_mm.PATHS, or
        "torch._int_mm"); None for other pairs."""
        return kernel_path() if self.precision == "int8" and self.device.type == "cpu" else None

    @property
    def max_context(self) -> int:
        return int(getattr(self.target.config, "max_position_embeddings", 2048))


def measured_lane(pair: ModelPair, *setting) -> ModelPair:
    """The pair with a memory of its own for one measured setting (policy, options, budget, ...): what
    a policy keeps across generations (Token Recycling's table, suffix decoding's earlier answers)
    carries over between the prompts a bench or replay runs at that setting, as a server running
    it would, and never from one setting's answer to another setting's run of the same prompt."""
    lanes = pair.memo.setdefault("lanes", {})
    return replace(pair, memo=lanes.setdefault(json.dumps(setting, sort_keys=True, default=str), {}))


def pair_key(pair: ModelPair) -> str:
    """The file name stem of what is trained or measured for a target and draft (heads, acceptance)."""
    return f"{pair.target_name}--{pair.draft_name}".replace("/", "_").replace(":", "_")


@forward_thread
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
    hub id: dyspec.drafts.eagle), `medusa:PATH` (published Medusa heads, likewise:
    dyspec.drafts.medusa), `truncated:N` (the target's first N layers, untrained), `int8`
    (the target with int8 Linear layers: a draft that needs no training, for a target that runs at
    native precision), `self` (the target itself, for testing), or None. Several drafts,
    comma-separated ("int8,distilled"), are merged into one tree by `specinfer`; every other policy
    drafts with the first.
    Hub ids load from the local cache unless `allow_download`. `precision` "auto" runs int8 Linear
    layers on a CPU (unless the draft is int8, which drafts for the fp32 target); outputs are then
    exact with respect to that int8 model. "fp32" gives the GGUF's fp32 weights as they are.
    `fast_path`: "auto" is the device's default (`dyspec.defaults`), "off" (Hugging Face forwards),
    "lean" (dyspec.forward.lean), "static" or "compiled" (dyspec.forward.static): chosen here, once
    per model (`ModelPair.forward`)."""
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
    check_drafts(target_model, drafts, specs)
    if precision == "int8":
        quantize(target_model, drafts)
    pair = ModelPair(
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
    for model in (pair.target, *drafts):
        pair.forward(model)
    return pair


def check_drafts(target: PreTrainedModel, drafts: list[nn.Module], specs: list) -> None:
    """Drafts fit their target: the same vocabulary, and feature drafts that read the same layers."""
    for spec, model in zip(specs, drafts):
        if model.config.vocab_size != target.config.vocab_size:
            raise DyspecError(
                f"draft '{spec.name}' has {model.config.vocab_size} output logits, the target "
                f"{target.config.vocab_size}: they must be equal"
            )
    if len({d.feature_layers for d in map(draft_model, drafts) if d.needs_features}) > 1:
        names = ",".join(spec.name for spec in specs)
        raise DyspecError(f"the feature drafts in '{names}' read different target layers: merge ones that agree")


def quantize(target: PreTrainedModel, drafts: list[nn.Module]) -> None:
    """int8 Linear layers in the target and every draft, once per model (a draft may be the target)."""
    models = [m for m in (target, *drafts) if isinstance(m, PreTrainedModel)]
    for model in {id(m): m for m in models}.values():
        quantize_int8(model)
        model.set_attn_implementation(attention.NAME)
    for model in drafts:
        if not isinstance(model, PreTrainedModel):  # a draft of dyspec's own: its own layers
            model.quantize_int8()
