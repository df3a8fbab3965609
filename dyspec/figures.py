"""Plotly figures from event data and bench records: plain functions, shared by the widgets, the
web app and the bench report, so that all show the same pictures. Imports no engine code."""

from __future__ import annotations

from collections import defaultdict

import plotly.graph_objects as go

CALIBRATION_BINS = 10


def calibration_counts(steps) -> tuple[list[int], list[int]]:
    """DySpec's premise: per bin of draft probability, how many tree nodes the verifier reached
    (their parent was on the accepted path) and how many of those it accepted."""
    reached, accepted = [0] * CALIBRATION_BINS, [0] * CALIBRATION_BINS
    for s in steps:
        on_path = {0, *s.accepted}
        for node in range(1, len(s.tokens)):
            if s.parents[node] in on_path:
                b = min(int(s.draft_probs[node] * CALIBRATION_BINS), CALIBRATION_BINS - 1)
                reached[b] += 1
                accepted[b] += node in on_path
    return reached, accepted


def calibration_figure(reached: list[int], accepted: list[int], title: str = "Draft probability vs acceptance"):
    centers = [(i + 0.5) / CALIBRATION_BINS for i in range(CALIBRATION_BINS)]
    rate = [a / r if r else None for a, r in zip(accepted, reached)]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="ideal", line={"dash": "dot", "color": "gray"}))
    fig.add_trace(
        go.Scatter(x=centers, y=rate, mode="lines+markers", name="observed", text=[f"{r} nodes" for r in reached])
    )
    fig.update_layout(
        title=title,
        xaxis_title="draft probability of the node's token",
        yaxis_title="fraction accepted when reached",
        xaxis_range=[0, 1],
        yaxis_range=[0, 1],
    )
    return fig


def summarize(records: list[dict]) -> list[dict]:
    """One row per (dataset, policy, budget, temperature): tokens per forward and the speedup over
    `ar` on the same prompts, as total tokens / total seconds of each, measured in the same run."""
    groups = defaultdict(list)
    for r in records:
        groups[r["dataset"], r["policy"], r["budget"], r["temperature"]].append(r)
    ar = {(r["dataset"], r["prompt_id"], r["temperature"], r["seed"]): r for r in records if r["policy"] == "ar"}
    rows = []
    for (dataset, policy, budget, temperature), rs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        paired = [(r, ar[k]) for r in rs if (k := (dataset, r["prompt_id"], temperature, r["seed"])) in ar]
        forwards = sum(r["target_forwards"] or 0 for r in rs)
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
                "tokens_per_s": sum(r["new_tokens"] for r in rs) / sum(r["wall_s"] for r in rs),
                "speedup": speed / ar_speed if paired else None,
            }
        )
    return rows


def speedup_figure(rows: list[dict], metric: str = "speedup"):
    fig = go.Figure()
    for (policy, temperature), rs in _by(rows, "policy", "temperature").items():
        rs = sorted(rs, key=_budget_order)
        fig.add_trace(
            go.Bar(x=[str(r["budget"]) for r in rs], y=[r[metric] for r in rs], name=f"{policy} T={temperature}")
        )
    label = {"speedup": "speedup vs ar (same prompts, same run)", "tokens_per_forward": "tokens per target forward"}
    fig.update_layout(barmode="group", title=label.get(metric, metric), xaxis_title="budget", yaxis_title=metric)
    if metric == "speedup":
        fig.add_hline(y=1.0, line_dash="dot", line_color="gray")
    return fig


def latency_figure(profile: dict) -> go.Figure:
    fig = go.Figure()
    for name in ("target", "draft"):
        if profile.get(name):
            n = sorted(profile[name], key=int)
            fig.add_trace(
                go.Scatter(x=[int(k) for k in n], y=[profile[name][k] for k in n], mode="lines+markers", name=name)
            )
    fig.update_layout(
        title=f"Forward latency t(n) on {profile.get('device', '?')}",
        xaxis_title="tokens per forward n",
        yaxis_title="ms",
        xaxis_type="log",
    )
    return fig


def accept_length_figure(records: list[dict]) -> go.Figure:
    fig = go.Figure()
    for (policy, budget), rs in _by(records, "policy", "budget").items():
        hist = defaultdict(int)
        for r in rs:
            for length, count in r["accept_lengths"].items():
                hist[int(length)] += count
        if hist:
            xs = sorted(hist)
            fig.add_trace(go.Bar(x=xs, y=[hist[x] for x in xs], name=f"{policy} b={budget}"))
    fig.update_layout(
        title="Accepted draft tokens per step", xaxis_title="accepted tokens", yaxis_title="steps", barmode="group"
    )
    return fig


def _budget_order(row: dict) -> int:
    return row["budget"] if isinstance(row["budget"], int) else 10**9  # "auto" last


def _by(rows, *keys) -> dict:
    out = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r)
    return out
