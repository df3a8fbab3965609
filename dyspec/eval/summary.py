"""Statistics over bench records: one row per configuration (`summarize`), and `--budget auto`
against the best fixed budget, paired by prompt (`auto_vs_fixed`)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from dyspec.defaults import policy_spec


def policy_label(record: dict) -> str:
    """The policy with the options it ran with, as in a bench spec: `specdecpp:h=0.3`."""
    return policy_spec(record["policy"], record["options"])


def _row_order(dataset: str, policy: str, budget: int | str, temperature: float) -> tuple:
    """`ar` first, then policies by name, budgets by size with `auto` last."""
    return dataset, policy != "ar", policy, budget == "auto", 0 if budget == "auto" else budget, temperature


def summarize(records: list[dict]) -> list[dict]:
    """One row per (dataset, policy with its options, budget, temperature): tokens and verified tree
    nodes per target forward, the speedup over `ar` on the same prompts, as total tokens / total
    seconds of each, measured in the same run, and where a step's time went (`step_ms`)."""
    groups = defaultdict(list)
    for r in records:
        groups[r["dataset"], policy_label(r), r["budget"], r["temperature"]].append(r)
    ar = {(r["dataset"], r["prompt_id"], r["temperature"], r["seed"]): r for r in records if r["policy"] == "ar"}
    rows = []
    for (dataset, policy, budget, temperature), rs in sorted(groups.items(), key=lambda kv: _row_order(*kv[0])):
        paired = [(r, ar[k]) for r in rs if (k := (dataset, r["prompt_id"], temperature, r["seed"])) in ar]
        forwards = sum(r["target_forwards"] or 0 for r in rs)
        nodes = [r.get("tree_nodes") for r in rs]  # absent from records before 0.2.1
        speed = sum(r["new_tokens"] for r, _ in paired) / max(sum(r["wall_s"] for r, _ in paired), 1e-9)
        ar_speed = sum(a["new_tokens"] for _, a in paired) / max(sum(a["wall_s"] for _, a in paired), 1e-9)
        rows.append(
            {
                "dataset": dataset,
                "policy": policy,
                "budget": budget,
                "temperature": temperature,
                "runs": len(rs),
                "tokens_per_forward": sum(r["new_tokens"] for r in rs) / forwards if forwards else None,
                "nodes_per_forward": sum(nodes) / forwards if forwards and None not in nodes else None,
                "tokens_per_s": sum(r["new_tokens"] for r in rs) / sum(r["wall_s"] for r in rs),
                "speedup": speed / ar_speed if paired else None,
                "step_ms": step_ms(rs),
            }
        )
    return rows


STEP_PARTS = ("target", "draft", "overhead")  # a step's seconds: `<part>_s` in a record


def step_ms(records: list[dict]) -> dict[str, float] | None:
    """Milliseconds of an average step (one target forward) in the target's forward, the drafts'
    forwards and everything else (building the tree, verifying, committing), over the records that
    time them (not the peers'); None if none does."""
    timed = [r for r in records if r.get("target_s") is not None and r["target_forwards"]]
    steps = sum(r["target_forwards"] for r in timed)
    return {part: 1e3 * sum(r[f"{part}_s"] for r in timed) / steps for part in STEP_PARTS} if steps else None


MIN_PAIRS = 10


def auto_vs_fixed(records: list[dict], rows: list[dict]) -> list[dict]:
    """For each (dataset, policy, temperature) run with `--budget auto` and fixed budgets: `auto`'s
    speed over the best fixed budget's (by `summarize`'s speedup, else tokens/s), paired by prompt
    and seed (time per token of each pair), as the geometric mean ratio and its 95% interval, a
    normal approximation given from MIN_PAIRS pairs (narrower than Student's t, less so with more
    pairs). On a shared CPU one pass moves by a few percent, so a single speedup cannot say which
    is faster."""
    fixed = defaultdict(list)
    for row in rows:
        if row["budget"] != "auto":
            fixed[row["dataset"], row["policy"], row["temperature"]].append(row)
    time_per_token = defaultdict(dict)  # (dataset, policy, T, budget) -> (prompt, seed) -> seconds
    for r in records:
        run = (r["dataset"], policy_label(r), r["temperature"], r["budget"])
        time_per_token[run][r["prompt_id"], r["seed"]] = r["wall_s"] / max(r["new_tokens"], 1)
    out = []
    for key, candidates in sorted(fixed.items(), key=lambda kv: str(kv[0])):
        best = max(candidates, key=lambda row: row["speedup"] or row["tokens_per_s"])
        auto, other = time_per_token[(*key, "auto")], time_per_token[(*key, best["budget"])]
        logs = [math.log(other[pair] / t) for pair, t in auto.items() if pair in other]
        if not logs:
            continue
        mean = statistics.mean(logs)
        half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) >= MIN_PAIRS else math.nan
        dataset, policy, temperature = key
        out.append(
            {
                "dataset": dataset,
                "policy": policy,
                "temperature": temperature,
                "best_fixed": best["budget"],
                "pairs": len(logs),
                "ratio": math.exp(mean),
                "low": math.exp(mean - half),
                "high": math.exp(mean + half),
            }
        )
    return out
