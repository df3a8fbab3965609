"""`dyspec bench`: policies x budgets x temperatures x seeds over real prompt sets, every policy
measured side by side with autoregressive decoding (`ar`), Hugging Face's own generation (`hf`,
plain `model.generate`; `hf-assisted`, `generate(assistant_model=draft)`, with the target's int8
copy as its draft on a CPU where the pair's draft reads the target's features; `hf-lookup`,
`generate(prompt_lookup_num_tokens=budget)`) and llama.cpp (`llamacpp`, `llamacpp-lookup`:
dyspec.eval.peers) on the same prompts.

One JSON record per run, appended to a JSONL file as a single write (a crash leaves at most one
partial last line, which `--resume` ignores); an HTML report with plotly charts at the end.
"""

from __future__ import annotations

import copy
import datetime
import functools
import hashlib
import html
import itertools
import json
import math
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import plotly.io as pio
import torch
from tqdm.auto import tqdm

from dyspec import figures
from dyspec.auto import whatif
from dyspec.auto.budget import AutoState
from dyspec.auto.profile import floor_text, kernel_stamp, stamp_text
from dyspec.core.draft_model import draft_model
from dyspec.core.events import GenerationFinished, StepVerified
from dyspec.core.kv import sync
from dyspec.decode.engine import check_settings, encode_prompt, stream
from dyspec.defaults import DEFAULT, defaults_for
from dyspec.errors import DyspecError
from dyspec.eval import summary
from dyspec.eval.anatomy import step_counts
from dyspec.eval.peers import LLAMACPP_POLICIES, LlamaCpp, PeerCrashed, check_llamacpp
from dyspec.eval.prompts import load_prompts
from dyspec.eval.speedup import warm_up
from dyspec.forward import thread
from dyspec.forward.quant import int8_available, quantize_int8
from dyspec.forward.thread import forward_thread
from dyspec.load import ModelPair
from dyspec.load.pair import measured_lane
from dyspec.policies import parse_policy_spec

HF_POLICIES = ("hf", "hf-assisted", "hf-lookup")
PEERS = (*HF_POLICIES, *LLAMACPP_POLICIES)  # baselines outside the engine: records without step data
ONE_BUDGET = ("ar", "hf", "llamacpp")  # policies that draft nothing run at budget 1 alone
ANATOMY_TOKENS = 16  # the counted generation's length (`setting_anatomy`)
SCHEMA = json.loads((Path(__file__).with_name("bench_schema.json")).read_text())


@dataclass
class BenchConfig:
    dataset: str = "mtbench"
    num_prompts: int = 10
    spread: bool = False  # num_prompts evenly spaced over the set, not the first (load_prompts)
    policies: tuple[str, ...] = ("ar", "chain", "dyspec")
    budgets: tuple[int, ...] = (8, 16)
    temperatures: tuple[float, ...] = (0.0,)
    seeds: tuple[int, ...] = (0,)
    max_new_tokens: int = 64
    options: dict | None = None  # policy -> options


def record_key(r: dict) -> tuple:
    return (
        r["dataset"],
        r["prompt_id"],
        r["policy"],
        r["budget"],
        r["temperature"],
        r["seed"],
        json.dumps(r["options"], sort_keys=True),
    )


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the partial last line of an interrupted bench
            continue
    return records


def append_record(path: Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _engine_run(
    pair: ModelPair,
    prompt: str,
    policy: str,
    budget: int,
    temperature: float,
    seed: int,
    max_new_tokens: int,
    options: dict,
    auto_state: AutoState | None = None,
) -> dict:
    steps, finished = [], None
    kwargs = {"options": options, "auto_state": auto_state}
    pair = measured_lane(pair, policy, options, budget, temperature, seed)  # memories kept per setting
    for e in stream(pair, prompt, policy, budget, temperature, seed, max_new_tokens, **kwargs):
        if isinstance(e, StepVerified):
            steps.append(e)
        elif isinstance(e, GenerationFinished):
            finished = e
    reached, accepted = figures.calibration_counts(steps)
    return {
        "new_tokens": finished.new_tokens,
        "target_forwards": finished.target_forwards,
        "tokens_per_forward": finished.tokens_per_forward,
        "mean_accepted": sum(s.accepted_len for s in steps) / max(len(steps), 1),
        "wall_s": finished.wall_s,
        "draft_s": sum(s.draft_s for s in steps),
        "target_s": sum(s.target_s for s in steps),
        "overhead_s": sum(s.overhead_s for s in steps),
        "tree_build_s": sum(s.tree_build_s for s in steps),
        "tree_nodes": sum(len(s.tokens) - 1 for s in steps),
        "step_shapes": whatif.step_shapes(steps),
        "draft_forwards": finished.draft_forwards,
        "accept_lengths": {str(k): v for k, v in sorted(Counter(s.accepted_len for s in steps).items())},
        "calibration": {"reached": reached, "accepted": accepted},
        "output_digest": hashlib.sha1(json.dumps(finished.token_ids).encode()).hexdigest()[:16],
    }


def setting_anatomy(
    pair: ModelPair, prompt: str, policy: str, budget: int | str, options: dict, temperature: float, cache: dict
) -> dict:
    """A setting's ops and host reads a step (`dyspec.eval.anatomy.step_counts`, medians), counted once
    per setting in `cache` in a generation of its own on the first `prompt` it meets: counting slows
    a run, so no measured run is counted. On a GPU each op is a launch and each read waits for the
    queue: the two say there what a CPU's timings cannot."""
    key = (policy, json.dumps(options, sort_keys=True), budget, temperature)
    if key not in cache:
        counts = step_counts(pair, prompt, policy, budget, ANATOMY_TOKENS, options=options, temperature=temperature)
        cache[key] = {"step_ops": counts["ops"], "step_reads": counts["reads"]}
    return cache[key]


def independent_draft(pair: ModelPair) -> bool:
    """Whether the pair's draft is a model of its own, as Hugging Face's assisted generation needs
    (not none, not a feature draft)."""
    return pair.draft is not None and not draft_model(pair.draft).needs_features


def hf_assistant(pair: ModelPair, options: dict) -> torch.nn.Module:
    """The draft `hf-assisted` runs with: the pair's own, or with `assistant=int8` the target's int8
    copy (`--draft int8`; on an int8 pair, the target's weights again)."""
    if options.get("assistant") != "int8":
        return pair.draft
    return quantize_int8(copy.deepcopy(pair.target))


@forward_thread
def _hf_run(
    pair: ModelPair,
    prompt: str,
    policy: str,
    budget: int,
    temperature: float,
    seed: int,
    max_new_tokens: int,
    assistant: torch.nn.Module | None = None,
) -> tuple[int, float]:
    """Hugging Face generation on the same prompt: plain; assisted by `assistant` with a constant
    schedule of `budget` drafted tokens per step (num_assistant_tokens_schedule="constant"), or HF's
    adaptive "heuristic" schedule (starting at 4) for budget "auto"; or HF's prompt lookup of
    `budget` tokens after a match of up to 6 tokens (as `lookup`), for "auto" its default of 10.
    Returns the new tokens and the wall seconds, prefill included."""
    ids = torch.tensor([encode_prompt(pair, prompt)], device=pair.device)
    kwargs = {
        "max_new_tokens": max_new_tokens,
        "do_sample": temperature > 0,
        "pad_token_id": pair.tokenizer.eos_token_id,
        "eos_token_id": sorted(pair.stop_ids),
    }
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=None, top_p=None)
    if policy == "hf-assisted":  # budget "auto" maps to HF's own adaptive ("heuristic") schedule
        schedule = "heuristic" if budget == "auto" else "constant"
        kwargs.update(
            assistant_model=assistant,
            num_assistant_tokens=4 if budget == "auto" else budget,
            num_assistant_tokens_schedule=schedule,
            assistant_confidence_threshold=0.0,
        )
    if policy == "hf-lookup":
        kwargs.update(prompt_lookup_num_tokens=10 if budget == "auto" else budget, max_matching_ngram_size=6)
    torch.manual_seed(seed)
    t = time.perf_counter()
    out = pair.target.generate(ids, **kwargs)
    sync(pair.device)
    return out.shape[1] - ids.shape[1], time.perf_counter() - t


def _peer_stats(new_tokens: int, wall_s: float) -> dict:
    """A peer's record: what it generated and how long it took; it reports no steps."""
    steps = ("target_forwards", "tokens_per_forward", "mean_accepted", "draft_s", "target_s", "overhead_s")
    return {
        "new_tokens": new_tokens,
        "wall_s": wall_s,
        **dict.fromkeys((*steps, "tree_build_s", "tree_nodes", "step_shapes", "draft_forwards")),
        "accept_lengths": {},
        "calibration": {"reached": [], "accepted": []},
    }


def rotated(items: list, k: int) -> list:
    """`items` started from its k-th (mod its length)."""
    k %= max(1, len(items))
    return items[k:] + items[:k]


def host(device: torch.device) -> str:
    """The machine a record was measured on, as a results page names it: the GPU, or the CPU's model
    and core count, and the threads its forwards ran on where fewer than the cores."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []  # none on macOS
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    cores, threads = os.cpu_count(), thread.threads()
    on = f" ({threads} thread{'s' * (threads > 1)})" if cores and threads < cores else ""
    return f"{names[0] if names else platform.processor() or 'CPU'}, {cores} cores{on}"


def host_stamp(pair: ModelPair, command: str | None) -> dict:
    """What a results page stamps a record with: the pair as it ran, the machine, the versions, the
    date and the command."""
    return {
        "device": str(pair.device),
        "dtype": str(pair.dtype).removeprefix("torch."),
        "precision": pair.precision,
        "fast_path": pair.fast_path,
        "target": pair.target_name,
        "draft": pair.drafts_label,
        "versions": {m: version(m) for m in ("dyspec", "torch", "transformers")},
        "host": host(pair.device) + stamp_text(kernel_stamp(pair)),
        "date": datetime.date.today().isoformat(),
        "command": command,
    }


def profile_stamp(pair: ModelPair, command: str | None) -> dict:
    """What a results page stamps a latency profile with (`host_stamp`'s machine, versions, date and
    command, and the pair as it ran)."""
    stamp = host_stamp(pair, command)
    pair_text = f"{stamp['target']} + {stamp['draft']}"
    return {k: stamp[k] for k in ("host", "versions", "date", "command")} | {"pair": pair_text}


def plan_bench(pair: ModelPair, config: BenchConfig) -> list[tuple]:
    """The bench's runs, checked before any runs, as (prompt id, prompt, temperature, seed, policy,
    options, budget), in one pass over the prompts per seed. Within each (prompt, temperature, seed),
    `ar` runs first so every other run has its reference; the others follow in an order rotated
    from group to group. A policy may carry its own options (`parse_policy_spec`), on top of
    `config.options`; `default` stands for the device's default policy with its options."""
    specs = {}
    for given in config.policies:
        spec = defaults_for(pair.device, pair.int8_kernel).spec if given == DEFAULT else given
        name, opts = parse_policy_spec(spec)
        specs[spec] = (name, {**(config.options or {}).get(name, {}), **opts})
        if name not in PEERS:
            for budget, temperature in itertools.product(config.budgets, config.temperatures):
                check_settings(name, budget, temperature, config.max_new_tokens, specs[spec][1])
    for spec, (name, opts) in specs.items():
        if name == "hf-assisted" and not independent_draft(pair) and opts.get("assistant") != "int8":
            if pair.device.type != "cpu" or not int8_available():
                raise DyspecError(
                    "hf-assisted needs an independent draft model (not none, not a feature draft): "
                    "give one with --draft NAME"
                )
            specs[spec] = (name, {**opts, "assistant": "int8"})  # the target's int8 copy, said in its row
    if any(name in LLAMACPP_POLICIES for name, _ in specs.values()):
        check_llamacpp(pair)
    prompts = load_prompts(config.dataset, config.num_prompts, config.spread)
    specs.setdefault("ar", ("ar", {}))
    runs = [
        (spec, budget)
        for spec in specs
        if spec != "ar"
        for budget in ([1] if specs[spec][0] in ONE_BUDGET else config.budgets)
    ]
    # one pass over the prompts per seed: `auto`, which learns across generations, never meets the
    # same prompt twice in a row, and at T = 0, where seeds only repeat, passes are repeated measurements.
    # After `ar`, each group starts one run further along the list, so a machine whose speed drifts
    # within a group favours no setting (a fixed order cannot tell a drift from a property of the
    # setting that always runs last).
    groups = itertools.product(config.seeds, prompts, config.temperatures)
    return [
        (pid, prompt, temperature, seed, *specs[spec], budget)
        for g, (seed, (pid, prompt), temperature) in enumerate(groups)
        for spec, budget in [("ar", 1), *rotated(runs, g)]
    ]


def run_bench(
    pair: ModelPair,
    config: BenchConfig,
    out: Path,
    resume: bool = False,
    progress: bool = True,
    command: str | None = None,
) -> list[dict]:
    """Run every combination (`plan_bench`) not yet in `out` (with `resume`), appending one record
    per run. Each record carries the host, the date and `command` (what a results page stamps it
    with)."""
    jobs = plan_bench(pair, config)
    out.parent.mkdir(parents=True, exist_ok=True)
    records = read_records(out) if resume else []
    tmp = out.with_name(out.name + ".tmp")  # rewrite without any partial line, atomically
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(out)
    done = {record_key(r) for r in records}
    ar_runs = {(r["prompt_id"], r["temperature"], r["seed"]): r for r in records if r["policy"] == "ar"}
    auto_states: dict[tuple, AutoState] = {}
    stamp = host_stamp(pair, command)
    llama, left_out = LlamaCpp(), 0
    assistants: dict[str, torch.nn.Module] = {}  # hf-assisted's drafts, by its options
    warmed: dict = {}  # `warm_up`'s
    counted: dict = {}  # `setting_anatomy`'s
    for pid, prompt, temperature, seed, policy, opts, budget in tqdm(jobs, desc="bench", disable=not progress):
        base = {
            "dataset": config.dataset,
            "prompt_id": pid,
            "policy": policy,
            "options": opts,
            "budget": budget,
            "temperature": temperature,
            "seed": seed,
            "max_new_tokens": config.max_new_tokens,
        }
        if record_key(base) in done:
            continue
        if policy in PEERS:
            peer = llama.run
            if policy in HF_POLICIES:
                key = json.dumps(opts, sort_keys=True)
                if policy == "hf-assisted" and key not in assistants:
                    assistants[key] = hf_assistant(pair, opts)
                peer = functools.partial(_hf_run, assistant=assistants.get(key))
            try:
                stats = _peer_stats(*peer(pair, prompt, policy, budget, temperature, seed, config.max_new_tokens))
            except PeerCrashed as e:  # its rows are left out, said once; the others go on
                if not left_out:
                    tqdm.write(f"{e}; its runs are left out", file=sys.stderr)
                left_out += 1
                continue
        else:
            # `auto` learns across the run's generations of one policy, temperature and options
            learnt = auto_states.setdefault((policy, temperature, json.dumps(opts, sort_keys=True)), AutoState())
            warm_up(pair, policy, budget, warmed, opts, temperature)  # no run measures a first run's costs
            stats = _engine_run(pair, prompt, policy, budget, temperature, seed, config.max_new_tokens, opts, learnt)
            stats |= setting_anatomy(pair, prompt, policy, budget, opts, temperature, counted)
        tokens_per_s = stats["new_tokens"] / stats["wall_s"]
        if policy == "ar":
            ar_runs[pid, temperature, seed] = {"tokens_per_s": tokens_per_s, **stats}
        ar = ar_runs.get((pid, temperature, seed)) or {}
        record = {
            **base,
            **stats,
            "tokens_per_s": tokens_per_s,
            "speedup_vs_ar": tokens_per_s / ar["tokens_per_s"] if ar else None,
            "same_as_ar": same_as_ar(stats, ar, temperature),
            **stamp,
        }
        append_record(out, record)
        records.append(record)
    llama.close()
    return records


def same_as_ar(stats: dict, ar: dict, temperature: float) -> bool | None:
    """Whether a greedy run's tokens are `ar`'s on the same prompt, as exactness promises (None at
    T > 0, and where either run's tokens are not known: a peer's)."""
    ours, theirs = stats.get("output_digest"), ar.get("output_digest")
    return ours == theirs if temperature == 0 and ours and theirs else None


def modelled(records: list[dict], row: dict, model: whatif.LatencyModel) -> float | None:
    """A summary row's speedup under `model`, from its records' step shapes (`dyspec.auto.whatif`)."""
    shapes = [
        tuple(shape)
        for r in records
        if (r["dataset"], summary.policy_label(r), r["budget"], r["temperature"])
        == (row["dataset"], row["policy"], row["budget"], row["temperature"])
        for shape in r.get("step_shapes") or []
    ]
    return whatif.modelled_speedup(shapes, model)


def markdown_table(
    rows: list[dict], records: list[dict] = (), whatif_models: Sequence[whatif.LatencyModel] = ()
) -> str:
    """The summary, with where an average step's time went; per model in `whatif_models`, a column
    of each row's speedup modelled on that hardware from the run's own trees."""
    lines = [
        "| dataset | policy | budget | T | runs | nodes/forward | tokens/forward | tokens/s | speedup vs ar "
        "| ms a step: target + draft + other |" + "".join(f" modelled on {m.name} |" for m in whatif_models),
        "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(whatif_models),
    ]
    for r in rows:
        npf = "-" if r["nodes_per_forward"] is None else f"{r['nodes_per_forward']:.1f}"
        tpf = f"{r['tokens_per_forward']:.2f}" if r["tokens_per_forward"] else "-"
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        split = " + ".join(f"{r['step_ms'][part]:.1f}" for part in summary.STEP_PARTS) if r.get("step_ms") else "-"
        line = (
            f"| {r['dataset']} | {r['policy']} | {r['budget']} | {r['temperature']:g} | {r['runs']} | "
            f"{npf} | {tpf} | {r['tokens_per_s']:.1f} | {sp} | {split} |"
        )
        for model in whatif_models:
            m = modelled(records, r, model)
            line += f" {m:.2f}x |" if m else " - |"
        lines.append(line)
    return "\n".join(lines)


def identity_table(records: list[dict]) -> str:
    """At T = 0, per policy and budget, how many runs gave `ar`'s tokens (`same_as_ar`); empty where
    the records do not say."""
    runs: dict[tuple, list[bool]] = {}
    for r in records:
        if r["policy"] != "ar" and r.get("same_as_ar") is not None:
            runs.setdefault((summary.policy_label(r), str(r["budget"])), []).append(r["same_as_ar"])
    if not runs:
        return ""
    lines = ["| policy | budget | greedy runs with ar's tokens |", "|---|---|---|"]
    lines += [f"| {label} | {budget} | {sum(same)} of {len(same)} |" for (label, budget), same in sorted(runs.items())]
    return "\n".join(lines)


def auto_table(records: list[dict], rows: list[dict]) -> str:
    """`auto` against the best fixed budget, paired (`summary.auto_vs_fixed`; no interval below
    `summary.MIN_PAIRS` pairs); empty without both."""
    compared = summary.auto_vs_fixed(records, rows)
    if not compared:
        return ""
    lines = [
        "| dataset | policy | T | best fixed budget | pairs | auto / best fixed (speed) | 95% interval |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in compared:
        interval = "-" if math.isnan(c["low"]) else f"{c['low']:.3f}-{c['high']:.3f}"
        lines.append(
            f"| {c['dataset']} | {c['policy']} | {c['temperature']:g} | {c['best_fixed']} | {c['pairs']} | "
            f"{c['ratio']:.3f} | {interval} |"
        )
    return "\n".join(lines)


def write_report(
    records: list[dict], path: Path, profile: dict | None = None, whatif_models: Sequence[whatif.LatencyModel] = ()
) -> None:
    rows = summary.summarize(records)
    engine = [r for r in records if r["policy"] not in PEERS]
    reached = [sum(c) for c in zip(*[r["calibration"]["reached"] for r in engine if r["calibration"]["reached"]])]
    accepted = [sum(c) for c in zip(*[r["calibration"]["accepted"] for r in engine if r["calibration"]["accepted"]])]
    figs = [figures.speedup_figure(rows), figures.speedup_figure(rows, "tokens_per_forward")]
    if profile:
        figs.append(figures.latency_figure(profile))
    if reached:
        figs.append(figures.calibration_figure(reached, accepted))
    figs.append(figures.accept_length_figure(engine))
    parts = [pio.to_html(f, full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figs)]
    meta = records[0] if records else {}
    tables = (markdown_table(rows, records, whatif_models), auto_table(records, rows))
    table = html.escape("\n\n".join(t for t in tables if t))
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>dyspec bench</title></head><body>"
        f"<h1>dyspec bench</h1><p>target {meta.get('target')}, draft {meta.get('draft')}, "
        f"device {meta.get('device')}, dtype {meta.get('dtype')}</p><pre>{table}</pre>"
        f"<pre>{html.escape(floor_text(profile or {}))}</pre>" + "".join(parts) + "</body></html>"
    )
    path.write_text(page, encoding="utf-8")
