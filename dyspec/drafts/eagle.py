"""Published EAGLE drafts as dyspec feature drafts, `--draft eagle:PATH` with PATH a local folder or,
with `--allow-download`, a hub id: EAGLE-1/2 (SafeAILab/EAGLE's layout; HASS uses the same) and
EAGLE-3 (SafeAILab/EAGLE's and SpecForge's layout, `Eagle3Draft`), told apart by their keys.

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

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from transformers import PreTrainedModel

from dyspec.core.kv import FINAL, cache_kwarg
from dyspec.drafts.checkpoint import read_weights
from dyspec.drafts.feature import FeatureDraft, causal_mask
from dyspec.errors import DyspecError
from dyspec.forward.quant import Int8Linear, quantize_int8

PREFIX = "eagle:"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# what a draft's layers must share with the target to run beside it, as EAGLE's config names it
MATCHING = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "intermediate_size")


def load_eagle(folder: Path, target: PreTrainedModel) -> FeatureDraft:
    """The EAGLE draft in `folder` (EAGLE-1/2, or EAGLE-3 where its layer is `midlayer`) as a
    feature draft of `target`, whose embedding (and for EAGLE-1/2 output layer) it reads."""
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
    tensors = read_weights(folder, WEIGHT_FILES, "EAGLE")
    tensors.pop("embed_tokens.weight", None)  # a copy of the target's, which the draft borrows
    if "fc.weight" not in tensors:
        raise DyspecError(f"{folder}: no fc.weight, so not an EAGLE layout (keys: {', '.join(sorted(tensors))})")
    read = load_eagle3 if any(k.startswith("midlayer.") for k in tensors) else load_eagle1
    draft = read(tensors, config, target)
    load_weights(draft, tensors, folder)
    draft.reads_first_token = False
    return draft.to(target.device).eval()


def load_eagle1(tensors: dict[str, torch.Tensor], config: dict, target: PreTrainedModel) -> FeatureDraft:
    """EAGLE-1/2's draft, its weights in `tensors` made dyspec's (in place)."""
    tensors.pop("layers.0.input_layernorm.weight", None)  # stored, never read
    H, fc = target.config.hidden_size, tensors["fc.weight"]
    tensors["fc.weight"] = torch.cat([fc[:, H:], fc[:, :H]], dim=1)  # dyspec reads [feature; embedding]
    vocab = torch.arange(target.config.vocab_size)
    layers, bias = config.get("num_hidden_layers", 1), config.get("bias", True)
    return FeatureDraft(target, vocab, FINAL, layers, fc_bias=bias, first_norm=False)


def load_weights(draft: nn.Module, tensors: dict[str, torch.Tensor], folder: Path) -> None:
    try:
        draft.load_state_dict({k: v.to(draft.dtype) if v.is_floating_point() else v for k, v in tensors.items()})
    except RuntimeError as e:  # missing, unexpected or misshapen keys: torch names them after its first line
        details = " ".join(line.strip() for line in str(e).splitlines()[1:])
        raise DyspecError(f"the EAGLE checkpoint in {folder} does not fit this target: {details}") from None


class Eagle3Draft(FeatureDraft):
    """EAGLE-3's draft (SafeAILab/EAGLE's and SpecForge's layout): it reads the target's states at
    three depths, the inputs of layers 2, L // 2 and L - 3 of L (HF's `hidden_states` at those
    indices, not normed), fused by fc into one feature g_{j-1}, and with the embedding e_j runs one
    layer whose attention reads both, normed apart:

        g = W_fc [low; mid; high]                  (its own prediction, inside a tree, as it is)
        a = Attention([norm_in(e_j); norm_h(g)])   (q, k, v read 2H; o writes H)
        h = g + a;  h = h + MLP(norm_post(h))
        logits over its own vocabulary = lm_head(norm(h)); draft token d is target token d + d2t[d]

    Keys: fc.weight [H, 3H]; midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight;
    midlayer.self_attn.{q,k,v}_proj.weight [*, 2H], midlayer.self_attn.o_proj.weight [H, *];
    midlayer.mlp.{gate,up,down}_proj.weight; norm.weight; lm_head.weight [draft vocabulary, H];
    d2t [draft vocabulary] (t2d and embed_tokens.weight are not needed)."""

    runs_lean = False  # its layer reads 2H: the Hugging Face layer's own forward

    def __init__(self, target: PreTrainedModel, config: dict, d2t: torch.Tensor):
        nn.Module.__init__(self)
        decoder, L = target.get_decoder(), target.config.num_hidden_layers
        if L < 4:
            raise DyspecError(f"an EAGLE-3 draft reads layers 2, L // 2 and L - 3 of its target's L; this one has {L}")
        self.feature_layers = (2, L // 2, L - 3)
        cfg = copy.deepcopy(target.config)
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps"):
            setattr(cfg, key, config.get(key, getattr(cfg, key)))
        H, heads, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.rms_norm_eps
        cfg.num_hidden_layers, cfg.head_dim, cfg._attn_implementation = 1, H // heads, "sdpa"
        self.config = cfg
        wide = copy.deepcopy(cfg)
        wide.hidden_size = 2 * H  # its attention reads [embedding; feature]
        attention = type(decoder.layers[0].self_attn)(wide, 0)
        attention.o_proj = nn.Linear(heads * cfg.head_dim, H, bias=False)
        self.midlayer = nn.ModuleDict(
            {
                "self_attn": attention,
                "mlp": type(decoder.layers[0].mlp)(cfg),
                "input_layernorm": nn.RMSNorm(H, eps=eps),
                "hidden_norm": nn.RMSNorm(H, eps=eps),
                "post_attention_layernorm": nn.RMSNorm(H, eps=eps),
            }
        )
        self.cache_name = cache_kwarg(attention.forward)
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.norm = nn.RMSNorm(H, eps=eps)
        self.lm_head = nn.Linear(H, len(d2t), bias=False)
        self.rotary = type(decoder.rotary_emb)(cfg)
        self.register_buffer("vocab", torch.arange(len(d2t)) + d2t.long(), persistent=False)
        self.borrowed = SimpleNamespace(embed=target.get_input_embeddings())
        self.reads_first_token = False

    @property
    def feature_size(self) -> int:
        return 3 * self.config.hidden_size

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        return (
            features.to(self.dtype)
            if features.shape[-1] == self.config.hidden_size
            else self.fc(features.to(self.dtype))
        )

    def quantize_int8(self) -> None:
        """The CPU fast path: the layer's products and the output layer in int8 (not fc: it runs once a step)."""
        for name in ("self_attn", "mlp"):
            quantize_int8(self.midlayer[name])
        self.lm_head = Int8Linear(self.lm_head.weight)

    def subset_logits(self, feature: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(feature))

    def predict(self, input_ids, features, position_ids, attention_mask=None, cache=None, slots=None) -> torch.Tensor:
        """FeatureDraft's; `slots` is never given (its layer never runs lean)."""
        layer = self.midlayer
        g = self.fused(features)
        embedded = self.borrowed.embed(input_ids).detach().to(self.dtype)
        x = torch.cat([layer["input_layernorm"](embedded), layer["hidden_norm"](g)], dim=-1)
        attention_mask = causal_mask(input_ids.shape[1], cache, x) if attention_mask is None else attention_mask
        a, _ = layer["self_attn"](
            x,
            position_embeddings=self.rotary(x, position_ids),
            attention_mask=attention_mask,
            **{self.cache_name: cache},
        )
        h = g + a
        return h + layer["mlp"](layer["post_attention_layernorm"](h))


def load_eagle3(tensors: dict[str, torch.Tensor], config: dict, target: PreTrainedModel) -> Eagle3Draft:
    """EAGLE-3's draft, its vocabulary map taken from `tensors` (in place)."""
    tensors.pop("t2d", None)  # the inverse of d2t
    dv = config.get("draft_vocab_size", target.config.vocab_size)
    d2t = tensors.pop("d2t", torch.zeros(dv, dtype=torch.long))
    if len(d2t) != dv or int((torch.arange(dv) + d2t).max()) >= target.config.vocab_size:
        raise DyspecError(f"EAGLE-3's d2t maps its {dv} draft tokens outside the target's {target.config.vocab_size}")
    return Eagle3Draft(target, config, d2t)
