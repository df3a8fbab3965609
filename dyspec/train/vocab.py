"""A draft's vocabulary (dyspec.core.vocab): which tokens it can propose, and how many.

Which: the most frequent in text the target answers with, the stop and special tokens always in,
so that a draft can propose an answer's end. How many (`choose_draft_vocab`, `dyspec draft-vocab`):
a draft's output layer is most of its forward, and a smaller one costs less but proposes fewer of
the target's tokens. So each candidate size V is measured as it would run: its draft forward timed
on this machine, its tokens per forward replayed (dyspec.decode.replay) along the target's own
answers to prompts it was not ranked on, and the two priced together by the what-if model
(dyspec.auto.whatif). Smaller vocabularies are subsets of the draft's own, so no retraining: the
draft gives q = 0 outside, and verification's residual covers the target's whole vocabulary
(FR-Spec, Zhao et al. 2025; VocabTrim, which ranks tokens on the target's own generations).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from dyspec.auto import whatif
from dyspec.auto.profile import first_draft_ms, pair_profile
from dyspec.decode.replay import Trace, record_trace, replay_run
from dyspec.defaults import setting_text, settings
from dyspec.drafts.feature import CONFIG_NAME, WEIGHTS_NAME
from dyspec.errors import DyspecError
from dyspec.load import ModelPair
from dyspec.train.corpus import training_prompts

SMALLEST = 512  # the smallest vocabulary `candidate_sizes` proposes


def ranked(counts: torch.Tensor, ids: torch.Tensor, always: Iterable[int] = ()) -> torch.Tensor:
    """`ids` most frequent first by `counts` (indexed by token id), `always` ahead of every other;
    ties in id order, which in a BPE vocabulary is the order of its merges, most frequent first."""
    ids = ids.long().sort().values
    score = counts[ids].double()
    score[torch.isin(ids, torch.tensor(sorted(always), dtype=torch.long))] = math.inf
    return ids[score.neg().sort(stable=True).indices]


def token_counts(sequences: Iterable[torch.Tensor | list[int]], vocab_size: int) -> torch.Tensor:
    return torch.bincount(torch.cat([torch.as_tensor(s, dtype=torch.long) for s in sequences]), minlength=vocab_size)


def choose_vocab(
    seqs: list[tuple[torch.Tensor, torch.Tensor]], size: int, vocab_size: int, always: Iterable[int] = ()
) -> torch.Tensor:
    """The `size` most frequent token ids in the training text, with `always` among them, in id order:
    the tokens a new draft can propose."""
    counts = token_counts([tokens for tokens, _ in seqs], vocab_size)
    return ranked(counts, torch.arange(vocab_size), always)[:size].sort().values


def always_in(pair: ModelPair) -> set[int]:
    """The tokens every draft vocabulary keeps: the stop and special tokens."""
    return {*pair.stop_ids, *pair.tokenizer.all_special_ids}


def draft_vocab(pair: ModelPair, seqs: list[tuple[torch.Tensor, torch.Tensor]], size: int) -> torch.Tensor:
    """A new draft's vocabulary for `pair`'s target: `choose_vocab` with its stop and special tokens."""
    return choose_vocab(seqs, size, pair.target.config.vocab_size, always_in(pair))


def candidate_sizes(size: int) -> list[int]:
    """A draft's own vocabulary size and its halvings down to SMALLEST."""
    sizes = [size]
    while sizes[-1] // 2 >= SMALLEST:
        sizes.append(sizes[-1] // 2)
    return sizes


def write_subset(folder: Path, out: Path, ids: torch.Tensor, info: dict | None = None) -> Path:
    """The feature draft in `folder` reading out only target tokens `ids` (a subset of its own) into
    `out`: the same weights (its output rows are the target's, borrowed at load time), its config
    naming the new size and what `info` adds."""
    tensors = load_file(folder / WEIGHTS_NAME)
    if not set(ids.tolist()) <= set(tensors["vocab"].tolist()):
        raise DyspecError(f"a smaller vocabulary for the draft in {folder} must be a subset of its own")
    out.mkdir(parents=True, exist_ok=True)
    save_file({**tensors, "vocab": ids.sort().values.int().contiguous()}, out / WEIGHTS_NAME)
    config = json.loads((folder / CONFIG_NAME).read_text())
    (out / CONFIG_NAME).write_text(json.dumps({**config, "draft_vocab": len(ids), **(info or {})}, indent=2))
    return out


def draft_times(pairs: list[ModelPair], rounds: int = 5) -> list[dict[int, float]]:
    """Each pair's draft forward as a step's first runs it (small trees draft about once a step),
    the pairs timed in turn over `rounds` rounds, so that a slow spell of a shared machine hits every
    candidate alike; per size, the median of its rounds."""
    times: list[list[dict[int, float]]] = [[] for _ in pairs]
    for _ in tqdm(range(rounds), desc="timing the drafts' forwards", unit="round"):
        for one, runs in zip(pairs, times):
            runs.append(first_draft_ms(one, repeats=3))
    return [{n: statistics.median(run[n] for run in runs) for n in runs[0]} for runs in times]


def measure_vocab(
    pair: ModelPair, traces: list[Trace], target_ms: dict, draft_ms: dict, setting: tuple[str, int | str, dict]
) -> dict:
    """One candidate, the pair's draft: the `setting` (policy, budget, options) replayed along
    `traces`, priced with the target's `target_ms` and the draft's `draft_ms` (n: ms)."""
    policy, budget, options = setting
    runs = [replay_run(pair, trace, policy, budget, dict(options)) for trace in traces]
    shapes = [shape for run in runs for shape in whatif.step_shapes(run.steps)]
    model = whatif.from_profile({"target": target_ms, "draft": draft_ms}, pair.draft_name)
    steps = len(shapes)
    return {
        "draft_vocab": len(pair.draft.vocab),
        "draft_ms": draft_ms,
        "tokens_per_forward": sum(run.tokens for run in runs) / max(steps, 1),
        "draft_forwards_per_step": sum(run.draft_forwards for run in runs) / max(steps, 1),
        "modelled_speedup": whatif.modelled_speedup(shapes, model),
    }


def choose_draft_vocab(
    pair: ModelPair,
    folder: Path,
    out: Path,
    load: Callable[[list[Path]], ModelPair],
    sizes: list[int] | None = None,
    num_prompts: int = 160,
    max_new_tokens: int = 96,
    prompts: list | None = None,
    setting: tuple[str, int | str, dict] | None = None,
) -> dict:
    """Measure the feature draft in `folder` (loaded as `pair.draft`) at each vocabulary size of
    `sizes` (default `candidate_sizes`) and return the report; every candidate is written to
    `out/vocab-V`, the best (the highest modelled speedup) named in the report. Tokens are ranked on
    the target's greedy answers to the first four fifths of `num_prompts` training prompts (or
    `prompts`); the setting (policy, budget, options; default the device's) is replayed along the
    rest. `load(folders)` loads the target as `pair` runs it with those drafts, in order."""
    own = pair.draft.vocab.cpu()
    sizes = sorted(set(sizes or candidate_sizes(len(own))), reverse=True)
    if any(not 0 < size <= len(own) for size in sizes):
        raise DyspecError(f"vocabulary sizes must be between 1 and the draft's own {len(own)}, got {sizes}")
    if num_prompts < 5:
        raise DyspecError(f"choosing a vocabulary needs at least 5 prompts, got {num_prompts}")
    setting = setting or settings(pair.device, None, None, None, pair.int8_kernel)
    chosen = training_prompts(pair, prompts, num_prompts)
    traces = [record_trace(pair, p, max_new_tokens) for p in tqdm(chosen, desc="target answers", unit="prompt")]
    n_test = max(1, len(traces) // 5)
    counts = token_counts([t.tokens for t in traces[:-n_test]], pair.target.config.vocab_size)
    order = ranked(counts, own, always_in(pair))
    origin = {"trimmed_from": {"folder": str(folder), "draft_vocab": len(own)}}
    folders = [write_subset(folder, out / f"vocab-{size}", order[:size], origin) for size in sizes]
    target_ms = pair_profile(pair)["target"]
    candidates = load(folders)
    ones = [
        replace(candidates, draft=draft, draft_name=str(path), extra_drafts=[], extra_draft_names=[])
        for draft, path in zip([candidates.draft, *candidates.extra_drafts], folders)
    ]
    rows = [
        {"folder": str(path), **measure_vocab(one, traces[-n_test:], target_ms, ms, setting)}
        for one, path, ms in zip(tqdm(ones, desc="vocabularies"), folders, draft_times(ones))
    ]
    best = max(rows, key=lambda row: (row["modelled_speedup"], row["draft_vocab"]))
    policy, budget, options = setting
    report = {
        "best": best,
        "candidates": rows,
        "setting": setting_text(policy, options, budget),
        "prompts": {"ranked_on": len(traces) - n_test, "replayed_on": n_test, "max_new_tokens": max_new_tokens},
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    config = Path(best["folder"]) / CONFIG_NAME  # its card says how its size was chosen
    choice = {k: report[k] for k in ("setting", "prompts")}
    choice["candidates"] = {row["draft_vocab"]: row["modelled_speedup"] for row in rows}
    config.write_text(json.dumps({**json.loads(config.read_text()), "vocab_choice": choice}, indent=2))
    return report


def vocab_table(report: dict) -> str:
    """The candidates as `dyspec draft-vocab` prints them, the best marked."""
    lines = [
        f"{report['setting']}, replayed on {report['prompts']['replayed_on']} held-out answers",
        "| vocabulary | draft forward, 1 token | tokens/forward | draft forwards/step | modelled speedup |",
        "|---|---|---|---|---|",
    ]
    for row in report["candidates"]:
        mark = " (best)" if row is report["best"] else ""
        lines.append(
            f"| {row['draft_vocab']}{mark} | {row['draft_ms'][1]:.2f} ms | {row['tokens_per_forward']:.2f} | "
            f"{row['draft_forwards_per_step']:.2f} | {row['modelled_speedup']:.2f}x |"
        )
    return "\n".join(lines)
