"""`dyspec replay`: policies x budgets replayed along the target's greedy trace of each prompt of a
set (dyspec.decode.replay, T = 0), one JSON record per run as `dyspec bench` writes them (kind
"replay"), summarised as tokens per forward against budget and priced with latency models: the
speedups are modelled, never measured (replay does not run the target)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from dyspec.auto import whatif
from dyspec.decode.engine import check_settings
from dyspec.decode.replay import ReplayRun, record_trace, replay_run
from dyspec.eval.bench import append_record, host_stamp
from dyspec.load import ModelPair
from dyspec.policies import parse_policy_spec

KIND = "replay"
REPLAY_NOTE = (
    "Replayed along the target's greedy trace (T = 0): tree sizes, tokens per forward and draft forwards "
    "are exact, as a real run gets them; the speedups are modelled from them with each latency profile "
    "(forwards only), not measured. Below 1x is slower than plain decoding."
)


def run_record(run: ReplayRun) -> dict:
    """What a record keeps of one replayed run."""
    return {
        "policy": run.policy,
        "budget": run.budget,
        "new_tokens": run.tokens,
        "target_forwards": len(run.steps),
        "tokens_per_forward": run.tokens_per_forward,
        "draft_forwards": run.draft_forwards,
        "tree_nodes": sum(len(s.tokens) - 1 for s in run.steps),
        "step_shapes": whatif.step_shapes(run.steps),
    }


def check_sweep(policies: Sequence[str], budgets: Sequence[int | str], max_new_tokens: int) -> dict[str, tuple]:
    """Each policy spec (`NAME[:OPTION=VALUE...]`) as (name, options), every setting checked."""
    settings = {spec: parse_policy_spec(spec) for spec in policies}
    for policy, options in settings.values():
        for budget in budgets:
            check_settings(policy, budget, 0.0, max_new_tokens, options)
    return settings


def run_sweep(
    pair: ModelPair,
    dataset: str,
    prompts: Sequence[tuple[str, str]],
    policies: Sequence[str],
    budgets: Sequence[int | str],
    max_new_tokens: int,
    out: Path,
    command: str | None = None,
    progress: bool = True,
) -> list[dict]:
    """Each prompt's (id, text) trace recorded once, then every policy at every budget along it; a
    record per run appended to `out` (rewritten first), `dataset` naming where the prompts came from.
    A policy may carry options as bench's do (`specdecpp:h=0.3`); its records are named so."""
    settings = check_sweep(policies, budgets, max_new_tokens)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    stamp = {"kind": KIND, "dataset": dataset, "max_new_tokens": max_new_tokens, **host_stamp(pair, command)}
    records = []
    bar = tqdm(total=len(prompts) * len(policies) * len(budgets), desc="replay", disable=not progress)
    for prompt_id, prompt in prompts:
        trace = record_trace(pair, prompt, max_new_tokens)
        for spec, (policy, options) in settings.items():
            for budget in budgets:
                run = replay_run(pair, trace, policy, budget, options)
                record = {"prompt_id": prompt_id, **run_record(run), "policy": spec, **stamp}
                append_record(out, record)
                records.append(record)
                bar.update()
    bar.close()
    return records


def sweep_rows(records: list[dict], models: Sequence[whatif.LatencyModel] = ()) -> list[dict]:
    """Per policy and budget over all prompts: tokens and tree nodes per target forward (totals over
    totals), draft forwards per step, and the speedup over `ar` modelled under each of `models`."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["policy"], r["budget"]), []).append(r)
    rows = []
    for (policy, budget), rs in groups.items():
        steps = sum(r["target_forwards"] for r in rs)
        shapes = [tuple(s) for r in rs for s in r["step_shapes"]]
        rows.append(
            {
                "policy": policy,
                "budget": budget,
                "prompts": len(rs),
                "tokens_per_forward": sum(r["new_tokens"] for r in rs) / max(steps, 1),
                "nodes_per_forward": sum(r["tree_nodes"] for r in rs) / max(steps, 1),
                "draft_forwards_per_step": sum(r["draft_forwards"] for r in rs) / max(steps, 1),
                "modelled": {m.name: whatif.modelled_speedup(shapes, m) for m in models},
            }
        )
    return sorted(rows, key=lambda r: (r["policy"], r["budget"] == "auto", r["budget"] if r["budget"] != "auto" else 0))


def sweep_table(rows: list[dict]) -> str:
    """The rows as Markdown: one modelled-speedup column per latency model."""
    names = list(rows[0]["modelled"]) if rows else []
    lines = [
        "| policy | budget | prompts | nodes/forward | tokens/forward | draft forwards/step |"
        + "".join(f" modelled on {n} |" for n in names),
        "|---|---|---|---|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        modelled = "".join(f" {v:.2f}x |" if v else " - |" for v in r["modelled"].values())
        lines.append(
            f"| {r['policy']} | {r['budget']} | {r['prompts']} | {r['nodes_per_forward']:.1f} | "
            f"{r['tokens_per_forward']:.2f} | {r['draft_forwards_per_step']:.2f} |{modelled}"
        )
    return "\n".join(lines)
