"""Pairs of a published shape with random weights, made on the device (`dyspec profile --shape`).

A forward's latency depends on the shapes it runs, not on its weights' values, so the latency of the
models people serve can be measured where their weights cannot be had (no hub, no disk): a target of
the model's configuration, and a feature draft of EAGLE-3's shape (one decoder layer reading three of
the target's layers, its own output rows over a reduced vocabulary). Their tokens mean nothing: such
a pair is for `dyspec profile` alone.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from dyspec.drafts.feature import FeatureDraft
from dyspec.errors import DyspecError
from dyspec.load.pair import ModelPair

LLAMA_3_1_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
SMOLLM2_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
}
# name -> (target config, the draft's target layers (EAGLE-3: a low, a middle and the final one), its vocabulary)
SHAPES = {
    "llama-3.1-8b": (LLAMA_3_1_8B, (2, 16, -1), 32000),
    "smollm2-135m": (SMOLLM2_135M, (-1,), 8192),
}


def shaped_pair(name: str, device: torch.device, dtype: torch.dtype, fast_path: str) -> ModelPair:
    """A target of shape `name` (SHAPES) with a feature draft of EAGLE-3's shape, random weights."""
    if name not in SHAPES:
        raise DyspecError(f"unknown shape {name!r}; choose one of: {', '.join(SHAPES)}")
    config, layers, vocab = SHAPES[name]
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=dtype).eval()
        draft = FeatureDraft(target, torch.arange(vocab), feature_layers=layers).to(device, dtype).eval()
    target.requires_grad_(False), draft.requires_grad_(False)
    label, tokenizer = f"shape:{name}", id_tokenizer(config["vocab_size"])
    return ModelPair(target, draft, tokenizer, label, f"{label}-eagle3", device, dtype, "native", fast_path=fast_path)


def id_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer whose tokens are their ids ("<17>"): the events of a generation name a random
    model's tokens with it."""
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<0>")))
