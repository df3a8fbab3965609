"""The measured latency profile t(n): milliseconds for one forward of n new tokens over a KV cache,
for the target and the draft. On a GPU t(n) is flat up to n ~ 64; on a CPU it is not, and that
decides the best tree budget."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from dyspec.cache import cache_dir, write_cache
from dyspec.core.kv import bucket, sync
from dyspec.drafts.feature import FeatureDraft
from dyspec.forward import thread
from dyspec.forward.choose import Forward, ModelForward, layers_stamp
from dyspec.forward.quant import Int8Linear
from dyspec.forward.thread import forward_thread
from dyspec.load import load_model

# Every n up to 16: fp32 forwards of a few rows on a CPU are lumpy, not smooth between powers of
# two (an odd size can cost more than the next power of two), and `--budget auto`, reading t(n)
# off a line through the powers of two, chose chains that cost more than longer ones.
DEFAULT_SIZES = (*range(1, 17), 24, 32, 48, 64, 80)
CONTEXT = 100  # cached tokens behind the profile's forwards
# a forward's time against the profile's t(1) beyond which, either way, one of the two was not measured
# as this machine runs it (the profile's context is shorter than most answers reach: not tighter)
PROFILE_MARGIN = 1.5
# A second context, at fewer sizes: on the int8 path, whose exact attention reads each row's
# keys apart, a tree token costs more behind a longer context, and `--budget auto` reads t(n) at
# each step's context (`cost.profile_at`)
LONG_CONTEXT, LONG_SIZES = 400, (1, 2, 4, 8, 16, 32, 64)
# a step's first draft forward (the root's: the tokens the last step committed), timed after a
# target forward, as it runs (`after_target`)
FIRST_SIZES = (1, 2, 4, 8)
METHOD = 6  # how `forward_ms` measures: a change makes saved profiles stale (`profile_path`)


@forward_thread
def forward_ms(
    model: PreTrainedModel,
    sizes=DEFAULT_SIZES,
    context: int = CONTEXT,
    repeats: int = 9,
    forward: Forward | None = None,
    before: Callable[[], None] | None = None,
) -> dict[int, float]:
    """Median wall milliseconds of a forward of n tokens after `context` cached tokens, with a tree
    mask for n > 1 as the engine sends it, on the engine's `forward` (`ModelPair.forward`; the
    model's own by default), timed as `median_ms` times it (`before`, untimed, before each)."""
    run, undo = profiled_forward(model, sizes, context, forward)
    return median_ms(run, undo, sizes, model.config.vocab_size, repeats, before=before)


def profiled_forward(
    model: PreTrainedModel, sizes, context: int, forward: Forward | None = None
) -> tuple[Callable[[list[int]], None], Callable[[], None]]:
    """A session of `model` behind `context` random cached tokens, as `forward_ms` times it: a
    forward of the tokens it is given, and what takes them out of the cache again."""
    g = torch.Generator().manual_seed(0)
    run = forward or ModelForward(model)
    # a draft as the engine runs it: its logits over its own vocabulary (dyspec.core.vocab)
    sizes_run = sorted({bucket(n) for n in sizes})
    kv = run.session("profile", context + bucket(max(sizes)), sizes_run, last_only=(False,), draft_vocab=True)
    kv.append(torch.randint(model.config.vocab_size, (context,), generator=g).tolist())

    def forward_tokens(tokens: list[int]) -> None:
        n = len(tokens)
        # one token goes without a mask, as the engine sends a step that drafted nothing (`ar`):
        # a mask costs an fp32 forward more, and `--budget auto` would take that for what not
        # drafting costs
        visible = torch.ones(n, n, dtype=torch.bool).tril() if n > 1 else None
        kv.forward(tokens, list(range(context, context + n)), visible)
        sync(kv.device)

    return forward_tokens, lambda: kv.commit([])


def after_target(pair) -> Callable[[], None]:
    """A one-token forward of the pair's target, as a step's verification runs just before the
    next step's first draft forward: on a CPU it streams the target's weights through the caches
    and the draft's weights leave them, so that draft forward reads them from memory."""
    run, undo = profiled_forward(pair.target, (1,), CONTEXT, pair.forward(pair.target))

    def target_forward() -> None:
        run([0])
        undo()

    return target_forward


def first_draft_ms(pair, repeats: int = 9) -> dict[int, float]:
    """The pair's draft forward at FIRST_SIZES as a step's first runs: on a CPU right after a target
    forward (`after_target`); elsewhere its weights stay where they are, and it runs as any other."""
    before = after_target(pair) if pair.device.type == "cpu" else None
    return forward_ms(pair.draft, FIRST_SIZES, repeats=repeats, forward=pair.forward(pair.draft), before=before)


def median_ms(
    forward: Callable[[list[int]], None],
    undo: Callable[[], None],
    sizes,
    vocab: int,
    repeats: int = 9,
    before: Callable[[], None] | None = None,
) -> dict[int, float]:
    """Median wall milliseconds of `forward(tokens)` for n random tokens per size n (at least
    `repeats` of them), `undo()` (its tokens leave the cache) untimed after each. Sizes take turns
    within each round, so a slow spell of a shared machine hits all of them alike, and a turn is an
    untimed forward of its size, then two timed ones, as decoding runs them: on the compiled int8
    forward a one-token forward right after a long one is slower than after another of one, and
    `--budget auto` took the difference for what a step of `ar` costs. `before()`, untimed, runs
    before each forward."""
    g = torch.Generator().manual_seed(0)
    times = {n: [] for n in sizes}
    for _ in range(-(-repeats // 2)):
        for n in sizes:
            for timed in (False, True, True):
                tokens = torch.randint(vocab, (n,), generator=g).tolist()
                if before is not None:
                    before()
                t = time.perf_counter()
                forward(tokens)
                if timed:
                    times[n].append((time.perf_counter() - t) * 1000)
                undo()
    return {n: statistics.median(ms) for n, ms in times.items()}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights every forward reads whatever its tokens: each Linear layer's (the output
    layer's included) as it runs, int8 or not. An embedding is read a row per token: left out."""
    total = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Int8Linear))
    weights = {m.weight.data_ptr(): m.weight for m in model.modules() if isinstance(m, nn.Linear)}  # tied: once
    if isinstance(model, FeatureDraft):  # its output rows are the target's, borrowed
        head = model.borrowed.int8_head
        if head is None:
            weights[model.borrowed.head.data_ptr()] = model.borrowed.head
        else:
            total += head.in_features * head.out_features
    return total + sum(w.numel() * w.element_size() for w in weights.values())


def memory_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second this device's memory moves: the best of `repeats` copies of a buffer too
    big for a cache, counting the bytes read and written."""
    a = torch.ones(megabytes * 2**20 // 4, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats + 1):
        t = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * a.element_size() / best


def floors(models: dict[str, nn.Module], device: torch.device) -> dict:
    """The floor under each model's t(1) on this machine: its weights' bytes over the measured memory
    bandwidth, the time a forward of one token takes at the least, however fast its kernels."""
    bandwidth = memory_bandwidth(device)
    mb = {name: weight_bytes(m) / 1e6 for name, m in models.items()}
    return {
        "bandwidth_gb_s": bandwidth / 1e9,
        "weights_mb": mb,
        "ms": {k: v * 1e6 / bandwidth * 1e3 for k, v in mb.items()},
    }


def floor_text(profile: dict) -> str:
    """Each model's t(1) against its floor, one line each ('' for a profile measured without)."""
    floor = profile.get("floor")
    if not floor:
        return ""
    lines = [f"t(1) against the floor (weight bytes / {floor['bandwidth_gb_s']:.1f} GB/s measured memory bandwidth):"]
    for name, ms in floor["ms"].items():
        t1 = profile[name]["1"]
        lines.append(f"  {name}: {t1:.1f} ms, floor {ms:.3g} ms ({floor['weights_mb'][name]:.3g} MB): {t1 / ms:.1f}x")
    return "\n".join(lines)


def kernel_stamp(pair) -> dict[str, str]:
    """What the target's kernels run on where one machine may run either of two: the int8 products'
    path (a CPU int8 pair, dyspec.kernels.int8_mm), or the GPU graph forward's layers, compiled or
    not (dyspec.forward.cuda_graph)."""
    if pair.int8_kernel:
        return {"int8_kernel": pair.int8_kernel}
    return layers_stamp(pair.forward(pair.target))


def stamp_text(profile: dict) -> str:
    """`kernel_stamp` as a header says it."""
    names = {"int8_kernel": "int8 kernel", "graph_layers": "layers"}
    return "".join(f", {names[key]} {profile[key]}" for key in names if key in profile)


@forward_thread
def measure_profile(pair, baseline: bool = True, draft: bool = True, sizes=DEFAULT_SIZES) -> dict:
    """t(n) of the pair's target and (with `draft`) its draft as they run (precision included), at
    `sizes`, and on a CPU a step's first draft forward (`draft_first`, after a target forward);
    with `baseline`, also the Hugging Face forward of the same target (where the pair runs another
    one) and a plain fp32 Hugging Face forward at n = 1 and 8, measured in the same run."""
    target = pair.forward(pair.target)
    profile = {
        "device": str(pair.device),
        "dtype": str(pair.dtype).removeprefix("torch."),
        "precision": pair.precision,
        "fast_path": pair.fast_path,
        **kernel_stamp(pair),
        "target": {str(n): ms for n, ms in forward_ms(pair.target, sizes, forward=target).items()},
        f"target_at_{LONG_CONTEXT}": {
            str(n): ms for n, ms in forward_ms(pair.target, LONG_SIZES, LONG_CONTEXT, forward=target).items()
        },
    }
    if draft and pair.draft is not None:
        drafted = [n for n in sizes if n <= max(DEFAULT_SIZES)]
        run = pair.forward(pair.draft)
        profile["draft"] = {str(n): ms for n, ms in forward_ms(pair.draft, drafted, forward=run).items()}
        if pair.device.type == "cpu":  # a GPU's draft weights stay in its memory whatever runs
            profile["draft_first"] = {str(n): ms for n, ms in first_draft_ms(pair).items()}
    measured = {"target": pair.target, **({"draft": pair.draft} if "draft" in profile else {})}
    profile["floor"] = floors(measured, pair.device)
    if baseline and not isinstance(target, ModelForward):  # the reference forward of the same target, beside
        profile["target_hf"] = {str(n): ms for n, ms in forward_ms(pair.target, LONG_SIZES).items()}
    if baseline:
        fp32 = load_model(pair.target_name, pair.device, torch.float32)
        profile["baseline_hf_fp32_eager"] = {str(n): ms for n, ms in forward_ms(fp32, (1, 8)).items()}
    return profile


def profile_path(pair) -> Path:
    """Where the pair's profile is cached: one file per target, draft, device, precision, fast path and
    int8 kernel path (`DYSPEC_INT8_PATH` forces a slower one), dyspec and torch version (a new kernel
    makes an old profile lie), intra-op threads (the web app leaves a core to the browser) and way of
    measuring (`METHOD`)."""
    key = (pair.target_name, pair.drafts_label, pair.device.type, pair.precision, version("dyspec"), version("torch"))
    key = (*key, pair.fast_path, *kernel_stamp(pair).values(), f"t{thread.threads()}")
    return cache_dir() / "profiles" / ("__".join(str(x).replace("/", "_") for x in (*key, f"m{METHOD}")) + ".json")


def pair_profile(pair, check_ms: float | None = None) -> dict:
    """This machine's t(n) of the pair's target (behind two contexts) and draft as they run: what
    `--budget auto` prices trees with and the hardware what-if prices a run with (dyspec.auto.whatif).
    Measured once (under a minute for the default pair on a CPU), then read from `profile_path`;
    `dyspec profile` measures it again. `check_ms`: a target t(1) just measured; where the cached
    one is off it by more than PROFILE_MARGIN either way, the profile is measured again now: it
    was measured while something else used the machine (a build, a test beside it), and would
    price every tree wrong."""
    path = profile_path(pair)
    if path.exists() and check_ms is not None:
        cached = json.loads(path.read_text())["target"]["1"]
        if not 1 / PROFILE_MARGIN <= check_ms / cached <= PROFILE_MARGIN:
            path.unlink()
    if not path.exists():
        write_cache(path, json.dumps(measure_profile(pair, baseline=False)))
    return json.loads(path.read_text())


def target_profiles(profile: dict) -> dict[int, dict[int, float]]:
    """The target's t(n) in ms per context (cached tokens) of a `pair_profile`."""
    contexts = {CONTEXT: profile["target"], LONG_CONTEXT: profile.get(f"target_at_{LONG_CONTEXT}")}
    return {c: {int(n): ms for n, ms in t.items()} for c, t in contexts.items() if t}


def profile_table(profile: dict) -> str:
    """A profile as `dyspec profile` prints it: t(n) per size, a column per forward measured."""
    labels = {
        "target": "target",
        f"target_at_{LONG_CONTEXT}": f"@{LONG_CONTEXT}",
        "draft": "draft",
        "draft_first": "1st-draft",
        "target_hf": "HF",
        "llamacpp": "llama.cpp",
        "baseline_hf_fp32_eager": "fp32 HF",
    }
    columns = [name for name in labels if name in profile]
    lines = [
        f"forward latency, ms (median) on {profile['device']}, {profile['precision']} ({profile['dtype']}), "
        f"fast path {profile['fast_path']}{stamp_text(profile)}",
        f"behind {CONTEXT} cached tokens; @{LONG_CONTEXT}: the target behind {LONG_CONTEXT}"
        + ("; 1st-draft: the draft right after a target forward, as a step's first" if "draft_first" in profile else "")
        + ("; HF: the same target on the Hugging Face forward" if "target_hf" in profile else ""),
        f"{'n':>4}" + "".join(f"{labels[c]:>10}" for c in columns),
    ]
    for n in profile["target"]:  # the others have fewer sizes: blank in the other rows
        lines.append(f"{n:>4}" + "".join(f"{profile[c][n]:10.1f}" if n in profile[c] else " " * 10 for c in columns))
    steps = [
        f"  {name}: {m['target_ms']:.2f} + {m['draft_ms']:.2f} ({m['draft_forwards']:.0f} forwards) + "
        f"{m['overhead_ms']:.2f}"
        for name, m in profile.get("steps", {}).items()
    ]
    if steps:
        steps.insert(0, "ms a step (policy@budget): target + draft + other (building, verifying, committing)")
    return "\n".join([*lines, floor_text(profile), *steps])
