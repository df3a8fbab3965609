"""A tiny real Llama pair with a 5-token vocabulary, whose exact sequence distribution can be enumerated."""

import itertools

import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dyspec.cache import cache_dir
from dyspec.load import ModelPair

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


def fresh_cache(monkeypatch, folder, shared: tuple[str, ...] = ("kernels",)) -> None:
    """DYSPEC_CACHE set to `folder`, empty but for the `shared` folders of the cache in use, linked:
    a test of what a cache holds need not build again what builds the same (the kernels; graphs)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in shared:
        (cache_dir() / name).mkdir(parents=True, exist_ok=True)
        (folder / name).symlink_to(cache_dir() / name)
    monkeypatch.setenv("DYSPEC_CACHE", str(folder))


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
    from dyspec.load.head import AcceptanceHead, save_head

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
    from dyspec.drafts.feature import FeatureDraft

    target = tiny_model(1, 2)
    torch.manual_seed(seed)
    draft = FeatureDraft(target, torch.tensor([0, 1, 2, 4]), feature_layers, num_layers).eval()
    return ModelPair(
        target, draft, tiny_tokenizer(), "tiny-target", "tiny-feature-draft", torch.device("cpu"), torch.float32
    )


def save_eagle(folder, tensors: dict, target, weights: str = "model.safetensors", **config) -> dict:
    """Save a checkpoint in EAGLE's layout: `tensors` in `weights`, and config.json with the
    target's shape and `config`."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    if weights.endswith(".safetensors"):
        save_file(tensors, folder / weights)
    else:
        torch.save(tensors, folder / weights)
    fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    shape = {k: getattr(target.config, k) for k in fields}
    (folder / "config.json").write_text(json.dumps({"rms_norm_eps": target.config.rms_norm_eps, **shape, **config}))
    return tensors


def random_layer(target, prefix: str, attention_input: int, seed: int) -> dict:
    """A Llama decoder layer's weights for `target`'s shape, random, its attention reading
    `attention_input` features, under `prefix`."""
    config = target.config
    H, inter = config.hidden_size, config.intermediate_size
    d = H // config.num_attention_heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):  # variance-preserving, so that a draft reading its own features stays finite at depth
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    return {
        prefix + "self_attn.q_proj.weight": rand(config.num_attention_heads * d, attention_input),
        prefix + "self_attn.k_proj.weight": rand(config.num_key_value_heads * d, attention_input),
        prefix + "self_attn.v_proj.weight": rand(config.num_key_value_heads * d, attention_input),
        prefix + "self_attn.o_proj.weight": rand(H, config.num_attention_heads * d),
        prefix + "mlp.gate_proj.weight": rand(inter, H),
        prefix + "mlp.up_proj.weight": rand(inter, H),
        prefix + "mlp.down_proj.weight": rand(H, inter),
        prefix + "post_attention_layernorm.weight": 1 + torch.randn(H, generator=g) / 10,
    }


def write_eagle_checkpoint(folder, target, bias: bool = True, weights: str = "pytorch_model.bin", seed: int = 4):
    """An EAGLE-1/2 draft for `target` in SafeAILab/EAGLE's published layout (its key names and
    config fields), random weights: what `--draft eagle:PATH` reads after a download."""
    H = target.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
        "fc.weight": torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5,
        "layers.0.input_layernorm.weight": torch.ones(H),  # stored by EAGLE, never read
        **random_layer(target, "layers.0.", H, seed),
    }
    if bias:
        tensors["fc.bias"] = torch.randn(H, generator=g) / 10
    return save_eagle(
        folder, tensors, target, weights, architectures=["LlamaForCausalLM"], num_hidden_layers=1, bias=bias
    )


def write_eagle3_checkpoint(folder, target, draft_vocab: tuple[int, ...] = (0, 1, 2, 4), seed: int = 5):
    """An EAGLE-3 draft for `target` in SafeAILab/EAGLE's and SpecForge's layout (key names, config
    fields, a reduced vocabulary `draft_vocab` of target ids as d2t offsets), random weights."""
    H, dv = target.config.hidden_size, len(draft_vocab)
    g = torch.Generator().manual_seed(seed)
    t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    t2d[list(draft_vocab)] = True
    tensors = {
        "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
        "fc.weight": torch.randn(H, 3 * H, generator=g) / (3 * H) ** 0.5,
        "midlayer.input_layernorm.weight": 1 + torch.randn(H, generator=g) * 0.1,
        "midlayer.hidden_norm.weight": 1 + torch.randn(H, generator=g) * 0.1,
        **random_layer(target, "midlayer.", 2 * H, seed),
        "norm.weight": 1 + torch.randn(H, generator=g) * 0.1,
        "lm_head.weight": torch.randn(dv, H, generator=g) * 3,
        "d2t": torch.tensor(draft_vocab) - torch.arange(dv),  # draft token i is target token i + d2t[i]
        "t2d": t2d,
    }
    return save_eagle(
        folder, tensors, target, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=dv
    )


def published_pair(target, draft: str) -> ModelPair:
    """`target` with the published draft `draft` ("eagle:FOLDER", "medusa:FOLDER"), read as `--draft` reads it."""
    from dyspec.load.draft_spec import load_draft, parse_draft

    spec = parse_draft(draft, "tiny-target")
    draft = load_draft(spec, target, tiny_tokenizer(), allow_download=False)
    return ModelPair(target, draft, tiny_tokenizer(), "tiny-target", spec.name, torch.device("cpu"), torch.float32)


def tiny_eagle_pair(folder) -> ModelPair:
    """The tiny target with an EAGLE-1/2 draft read from a checkpoint in the published layout."""
    target = tiny_model(1, 2)
    write_eagle_checkpoint(folder, target)
    return published_pair(target, f"eagle:{folder}")


def tiny_eagle3_pair(folder) -> ModelPair:
    """A tiny target of 8 layers (EAGLE-3 reads layers 2, 4 and 5) with an EAGLE-3 draft read from a
    checkpoint in the published layout."""
    target = tiny_model(1, 8)
    write_eagle3_checkpoint(folder, target)
    return published_pair(target, f"eagle:{folder}")


def write_medusa_checkpoint(
    folder, target, heads: int = 3, layers: int = 1, weights: str = "medusa_lm_head.safetensors", seed: int = 6
) -> dict:
    """Medusa heads for `target` in FasterDecoding/Medusa's published layout (key names, file names,
    config fields), random weights: what `--draft medusa:PATH` reads after a download."""
    import json

    from safetensors.torch import save_file

    H, V = target.config.hidden_size, target.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for k in range(heads):
        for j in range(layers):
            tensors[f"{k}.{j}.linear.weight"] = torch.randn(H, H, generator=g) / H**0.5
            tensors[f"{k}.{j}.linear.bias"] = torch.randn(H, generator=g) / 10
        tensors[f"{k}.{layers}.weight"] = torch.randn(V, H, generator=g) * 3 / H**0.5
    folder.mkdir(parents=True, exist_ok=True)
    if weights.endswith(".safetensors"):
        save_file(tensors, folder / weights)
    else:
        torch.save(tensors, folder / weights)
    config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny-target"}
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


def tiny_medusa_pair(folder) -> ModelPair:
    """The tiny target with three Medusa heads read from a checkpoint in the published layout."""
    target = tiny_model(1, 2)
    write_medusa_checkpoint(folder, target)
    return published_pair(target, f"medusa:{folder}")
