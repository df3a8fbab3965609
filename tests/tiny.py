"""A tiny real Llama pair with a 5-token vocabulary, whose exact sequence distribution can be enumerated."""

import itertools

import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dyspec.models import ModelPair

VOCAB = ["a", "b", "c", "d", "e"]


def tiny_model(seed: int, layers: int = 1) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper logits than the default init, so the distribution is not near uniform
        model.lm_head.weight.mul_(40)
    return model


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="a"))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def tiny_pair() -> ModelPair:
    return ModelPair(
        tiny_model(1, 2),
        tiny_model(2),
        tiny_tokenizer(),
        "tiny-target",
        "tiny-draft",
        torch.device("cpu"),
        torch.float32,
    )


@torch.inference_mode()
def exact_distribution(model: LlamaForCausalLM, prompt: list[int], n: int, temperature: float) -> torch.Tensor:
    """P(first n generated tokens) at `temperature`, over all V**n sequences in lexicographic order."""
    probs = []
    for seq in itertools.product(range(len(VOCAB)), repeat=n):
        logits = model(torch.tensor([prompt + list(seq[:-1])])).logits[0, len(prompt) - 1 :].float()
        p = torch.softmax(logits / temperature, -1)
        probs.append(float(torch.prod(p[torch.arange(n), torch.tensor(seq)])))
    return torch.tensor(probs)


def tiny_head_file(path, bias: tuple[float, float] | None = None, seed: int = 0) -> str:
    """An acceptance head for the tiny draft, saved like a trained one: random weights, or one whose
    output is fixed by `bias` (logits of reject, accept) whatever the hidden state."""
    from dyspec.models.head import AcceptanceHead, save_head

    torch.manual_seed(seed)
    head = AcceptanceHead(32, n_blocks=2)
    with torch.no_grad():
        head.out.weight.mul_(20)  # predictions that vary with the hidden state
        if bias is not None:
            head.out.weight.zero_()
            head.out.bias.copy_(torch.tensor(bias))
    save_head(head, path, {"target": "tiny-target", "draft": "tiny-draft"})
    return str(path)


def tiny_feature_pair(seed: int = 3, feature_layers: tuple[int, ...] = (-1,), num_layers: int = 1) -> ModelPair:
    """The tiny target with a feature-conditioned draft of `num_layers` decoder layers (random
    weights, its fusion of lower layers too) that can propose only 4 of the 5 tokens, so exactness
    is also checked where q is zero."""
    from dyspec.models.feature_draft import FeatureDraft

    target = tiny_model(1, 2)
    torch.manual_seed(seed)
    draft = FeatureDraft(target, torch.tensor([0, 1, 2, 4]), feature_layers, num_layers).eval()
    return ModelPair(
        target, draft, tiny_tokenizer(), "tiny-target", "tiny-feature-draft", torch.device("cpu"), torch.float32
    )


def write_eagle_checkpoint(folder, target, bias: bool = True, weights: str = "pytorch_model.bin", seed: int = 4):
    """An EAGLE-1/2 draft for `target` in SafeAILab/EAGLE's published layout (its key names and
    config fields), random weights: what `--draft eagle:PATH` reads after a download."""
    import json

    from safetensors.torch import save_file

    config = target.config
    H, inter, d = config.hidden_size, config.intermediate_size, config.hidden_size // config.num_attention_heads
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    tensors = {
        "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
        "fc.weight": rand(H, 2 * H),
        "layers.0.self_attn.q_proj.weight": rand(q_out, H),
        "layers.0.self_attn.k_proj.weight": rand(kv_out, H),
        "layers.0.self_attn.v_proj.weight": rand(kv_out, H),
        "layers.0.self_attn.o_proj.weight": rand(H, q_out),
        "layers.0.mlp.gate_proj.weight": rand(inter, H),
        "layers.0.mlp.up_proj.weight": rand(inter, H),
        "layers.0.mlp.down_proj.weight": rand(H, inter),
        "layers.0.input_layernorm.weight": torch.ones(H),  # stored by EAGLE, never read
        "layers.0.post_attention_layernorm.weight": 1 + rand(H, scale=0.1),
    }
    if bias:
        tensors["fc.bias"] = rand(H)
    folder.mkdir(parents=True, exist_ok=True)
    if weights.endswith(".safetensors"):
        save_file(tensors, folder / weights)
    else:
        torch.save(tensors, folder / weights)
    fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": 1,
                "rms_norm_eps": config.rms_norm_eps,
                "max_position_embeddings": config.max_position_embeddings,
                "bias": bias,
                **{k: getattr(config, k) for k in fields},
            }
        )
    )
    return tensors


def tiny_eagle_pair(folder) -> ModelPair:
    """The tiny target with an EAGLE-1/2 draft read from a checkpoint in the published layout."""
    from dyspec.models.draft_spec import load_draft, parse_draft

    target = tiny_model(1, 2)
    write_eagle_checkpoint(folder, target)
    spec = parse_draft(f"eagle:{folder}", "tiny-target")
    draft = load_draft(spec, target, tiny_tokenizer(), allow_download=False)
    return ModelPair(target, draft, tiny_tokenizer(), "tiny-target", spec.name, torch.device("cpu"), torch.float32)
