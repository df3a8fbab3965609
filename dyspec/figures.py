"""Plotly figures from event data and bench rows: plain functions, shared by the widgets, the web app
and the bench report, so that all show the same pictures. They draw; the statistics they draw live
with the records (dyspec.eval.summary). Imports nothing of dyspec, so any layer may draw with it."""

from __future__ import annotations

import html
import math
from collections import defaultdict
from collections.abc import Collection

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


def depth_counts(steps) -> tuple[list[int], list[int]]:
    """Acceptance by tree depth: per depth d (1, 2, ...), in how many steps the verifier reached
    depth d (the accepted path got to d - 1 and its node there had children) and in how many of those
    it accepted a token at d."""
    reached: list[int] = []
    accepted: list[int] = []
    for s in steps:
        path = [0, *s.accepted]
        has_children = set(s.parents[1:])
        for d, node in enumerate(path, start=1):
            if node not in has_children:
                break
            if len(reached) < d:
                reached.append(0)
                accepted.append(0)
            reached[d - 1] += 1
            accepted[d - 1] += d < len(path)
    return reached, accepted


def depth_figure(reached: list[int], accepted: list[int], title: str = "Acceptance by tree depth") -> go.Figure:
    """Per depth, the fraction of steps that accepted a token there when the verifier got there, with
    the count of such steps: where a tree's deep levels stop paying."""
    depths = list(range(1, len(reached) + 1))
    fig = go.Figure(
        go.Bar(
            x=depths,
            y=[a / r if r else None for a, r in zip(accepted, reached)],
            text=[f"{a} of {r}" for a, r in zip(accepted, reached)],
            textposition="outside",
            marker_color=COLORS["accepted"],
            hovertemplate="depth %{x}: %{text} steps accepted a token here<extra></extra>",
        )
    )
    fig.update_layout(
        title=title,
        xaxis={"title": "depth (tokens after the root)", "dtick": 1},
        yaxis={"title": "accepted when reached", "range": [0, 1.15], "tickformat": ".0%"},
        height=320,
        margin={"l": 50, "r": 20, "t": 50, "b": 40},
    )
    return fig


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
    for name in [k for k in profile if k.startswith("target")] + ["draft"]:  # target_at_400: a longer context
        if profile.get(name):
            n = sorted(profile[name], key=int)
            fig.add_trace(
                go.Scatter(x=[int(k) for k in n], y=[profile[name][k] for k in n], mode="lines+markers", name=name)
            )
    for name, ms in profile.get("floor", {}).get("ms", {}).items():  # weights / memory bandwidth
        fig.add_hline(y=ms, line_dash="dot", annotation_text=f"{name} floor {ms:.1f} ms")
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


# Okabe-Ito, safe for colour-blind readers; the text's highlights use the same two meanings
COLORS = {"root": "#000000", "accepted": "#009E73", "rejected": "#D55E00", "unreached": "#BBBBBB", "target": "#0072B2"}
LABEL_ALL = 24  # nodes up to which every node's token is written in the tree
# A bigger tree labels what the verifier reached, and where it has more rows than a figure has
# room for labels (a 256-node dynamic tree tries a hundred children of one node), only the
# accepted path and its LABEL_REJECTED likeliest rejected siblings; the hover names every node.
LABEL_ROWS, LABEL_REJECTED = 40, 8
# A label's box for 13 px monospace type, and the narrowest plot a tree is drawn in (the app's two a row on a
# 1280 px screen): labels that would overlap there are left to the hover
LABEL_PX, CHAR_PX, TREE_WIDTH_PX = 16, 8, 380
TREE_MARGIN = {"l": 20, "r": 20, "t": 60, "b": 160}  # the bottom holds the legend wrapped at that width
# Markers shrink where columns or rows are denser than this, so that a long chain stays a line of
# dots and not a smear
ROOM_COLUMNS, ROOM_ROWS = 40, 30
TICKS = 12  # depth ticks a tree's axis shows at most
LEGEND = {
    "root": "root: the last committed token",
    "accepted": "drafted, accepted",
    "rejected": "drafted, rejected",
    "unreached": "drafted, never tried",
    "target": "the target's own next token (bonus or correction)",
}
HIGHLIGHT = {"drafted": "#b5e6a2", "target": "#a9c8f0"}  # yellowish green, blue: apart for every reader


def node_outcomes(step) -> list[str]:
    """Per node: root, accepted (on the accepted path), rejected (tried by the verifier) or unreached
    (never tried). A child of a node on the path was tried, except, when sampling (T > 0), one drawn
    after the sibling that was accepted: the verifier tries siblings in drawing order and stops at
    the first it accepts. Greedy verification compares every child with the target's token."""
    on_path = {0, *step.accepted}
    sampled = bool(step.temperature)
    first_accepted = {step.parents[a]: a for a in step.accepted}  # a node's accepted child (ids in drawing order)

    def tried(i: int) -> bool:
        parent = step.parents[i]
        return parent in on_path and not (sampled and parent in first_accepted and i > first_accepted[parent])

    return [
        "root" if i == 0 else "accepted" if i in on_path else "rejected" if tried(i) else "unreached"
        for i in range(len(step.tokens))
    ]


def tree_layout(parents: list[int]) -> list[float]:
    """y position per node, a tidy layout: leaves in depth-first order get 0, 1, 2, ...; a parent
    sits at the mean of its children. Siblings never overlap and subtrees never cross."""
    children: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(parents[1:], start=1):
        children[p].append(i)
    y = [0.0] * len(parents)
    next_leaf = 0

    def place(node: int) -> None:
        nonlocal next_leaf
        for c in children[node]:
            place(c)
        if children[node]:
            y[node] = sum(y[c] for c in children[node]) / len(children[node])
        else:
            y[node] = next_leaf
            next_leaf += 1

    place(0)
    return y


WHITESPACE = str.maketrans({" ": "␣", "\n": "↵", "\t": "⇥", "\r": ""})


def token_label(text: str) -> str:
    """A token as a tree shows it: spaces as ␣, newlines as ↵, tabs as ⇥, so that a
    token that is all whitespace is still visible."""
    return text.translate(WHITESPACE) or "∅"


def sibling_ranks(parents: list[int]) -> tuple[list[int], dict[int, int]]:
    """Each node's order among its siblings, and each node's number of children."""
    rank, seen = [0] * len(parents), defaultdict(int)
    for i in range(1, len(parents)):
        rank[i] = seen[parents[i]]
        seen[parents[i]] += 1
    return rank, seen


def depth_window(x: list[int], outcome: list[str]) -> int:
    """The deepest depth a tree's figure opens on: all of it, unless it is deeper than ROOM_COLUMNS,
    then what the verifier reached and half that many depths more (a 128-node chain's first
    columns would be two pixels wide); plotly pans to the rest."""
    deepest = max(x, default=0)
    if deepest + 1 <= ROOM_COLUMNS:
        return deepest
    reached = max((d for d, k in zip(x, outcome) if k != "unreached"), default=0)
    return min(deepest, reached + ROOM_COLUMNS // 2)


TREE_MAX_HEIGHT = 600  # a tree fits a projector's 720 px below the page's tab bar; a bigger one writes fewer labels


def tree_height(rows: float) -> int:
    """A tree figure's height in pixels for its number of rows (leaves)."""
    return max(400, min(TREE_MAX_HEIGHT, 250 + 42 * rows))


def shown_labels(
    outcome: list[str], probs: list[float], texts: list[str], x: list[int], y: list[float], sizes: list[float]
) -> list[bool]:
    """Which nodes a tree writes the token of: the root, the target's token and the path first, then
    rejected nodes likeliest first (LABEL_ROWS, LABEL_REJECTED), then the unreached ones of a small
    tree (LABEL_ALL), each only where its label's box, at the plot's narrowest, overlaps none
    written before it: the hover names every node."""
    rows, columns = max(y, default=0) + 1, depth_window(x, outcome) + 1.3  # the axes' spans
    plot_height = tree_height(rows) - TREE_MARGIN["t"] - TREE_MARGIN["b"]

    def box(i: int) -> tuple[float, float, float]:  # centre x, centre y, half width, in pixels
        # where plotly puts a label's centre from its marker's, measured in a browser
        shift = -0.63 * sizes[i] - 9 if x[i] % 2 == 0 else 0.63 * sizes[i] + 6.5
        cy = (y[i] + 1) / (rows + 0.6) * plot_height + shift
        return (x[i] + 0.5) / columns * TREE_WIDTH_PX, cy, len(texts[i]) * CHAR_PX / 2

    rank = {"root": 0, "target": 1, "accepted": 2, "rejected": 3, "unreached": 4}
    order = sorted(
        range(len(outcome)), key=lambda i: (rank[outcome[i]], x[i] if outcome[i] == "accepted" else -probs[i])
    )
    rejected_room = LABEL_REJECTED if rows > LABEL_ROWS else len(outcome)
    shown: list[tuple[float, float, float]] = []
    keep = [False] * len(outcome)
    for i in order:
        if outcome[i] == "unreached" and len(outcome) > LABEL_ALL or outcome[i] == "rejected" and not rejected_room:
            continue
        cx, cy, half = box(i)
        if all(abs(cx - ox) >= half + oh or abs(cy - oy) >= LABEL_PX for ox, oy, oh in shown):
            shown.append((cx, cy, half))
            keep[i] = True
            rejected_room -= outcome[i] == "rejected"
    return keep


def tree_edges(parents: list[int], x: list, y: list, outcome: list[str]) -> list[go.Scatter]:
    """A tree's edges: thin grey, then the accepted path thick, last, over the others."""
    traces = []
    for on_path in (False, True):
        ex, ey = [], []
        for i in range(1, len(x)):
            if (outcome[i] in ("accepted", "target")) == on_path:
                p = parents[i]
                ex += [x[p], x[i], None]
                ey += [y[p], y[i], None]
        line = {"color": COLORS["accepted"], "width": 4} if on_path else {"color": "#999", "width": 1}
        traces.append(go.Scatter(x=ex, y=ey, mode="lines", line=line, hoverinfo="skip", showlegend=False))
    return traces


def node_hover(kind: str, predicted: bool) -> str:
    """A tree node's hover: its token, draft and target probability, path value, depth and sibling
    order, and the acceptance head's prediction where there is one; the target's own token was
    never drafted, so it has no probabilities to show."""
    if kind == "target":
        return "%{hovertext}<br>the target's own next token, not drafted<br>depth %{customdata[3]}<extra></extra>"
    return (
        "%{hovertext}<br>draft p %{customdata[0]:.3f}<br>target p %{customdata[1]:.3f}"
        "<br>path value %{customdata[2]:.3f}<br>depth %{customdata[3]}, sibling %{customdata[4]}"
        + ("<br>predicted acceptance %{customdata[5]}" if predicted else "")
        + "<extra></extra>"
    )


def tree_figure(step, upto: int | None = None, title: str | None = None) -> go.Figure:
    """The step's token tree, root at the left, one column per depth: colour by outcome, size by
    draft probability, the accepted path drawn thick and ended by the target's own next token (the
    bonus or correction, once the whole tree is shown), hover with draft and target probability,
    path value, depth and sibling order, and the acceptance head's prediction where the policy made
    one (specdecpp). `upto` shows only the first nodes in growth order, to replay how the tree grew."""
    n = len(step.tokens) if upto is None else max(1, min(upto, len(step.tokens)))
    parents, x = list(step.parents[:n]), list(step.depths[:n])
    outcome = node_outcomes(step)[:n]
    rank, seen = sibling_ranks(step.parents[:n])
    predicted = step.extra.get("predicted_acceptance", [])
    head = [
        f"{predicted[i - 1]:.3f}" if 0 < i <= len(predicted) and predicted[i - 1] is not None else "-" for i in range(n)
    ]
    texts = [token_label(t) for t in step.texts[:n]]
    if n == len(step.tokens) and len(step.emitted) > len(step.accepted):  # the target's token, after the path
        last = step.accepted[-1] if step.accepted else 0
        parents.append(last)
        x.append(x[last] + 1)
        outcome.append("target")
        texts.append(token_label(step.emitted_texts[len(step.accepted)]))
        rank.append(seen[last])
        head.append("-")
    y = tree_layout(parents)  # the target's token gets a row of its own
    leaves = max(y, default=0) + 1
    deepest = depth_window(x, outcome)
    room = min(1.0, ROOM_COLUMNS / (deepest + 1), ROOM_ROWS / leaves)
    size = [max(4.0, room * s) for s in [9 + 16 * p for p in step.draft_probs[:n]] + [14] * (len(x) - n)]
    probs = [*step.draft_probs[:n], *[math.nan] * (len(x) - n)]
    labelled = shown_labels(outcome, [*step.draft_probs[:n], *[1.0] * (len(x) - n)], texts, x, y, size)
    target_p = [*step.target_probs[:n], *[math.nan] * (len(x) - n)]
    values = [*step.values[:n], *[math.nan] * (len(x) - n)]
    fig = go.Figure(tree_edges(parents, x, y, outcome))
    for kind, color in COLORS.items():
        idx = [i for i in range(len(x)) if outcome[i] == kind]
        if not idx:
            continue
        fig.add_trace(
            go.Scatter(
                x=[x[i] for i in idx],
                y=[y[i] for i in idx],
                mode="markers+text",
                name=LEGEND[kind],
                text=[texts[i] if labelled[i] else "" for i in idx],
                hovertext=[texts[i] for i in idx],
                # above at even depths, below at odd ones: neighbours in a row do not overprint
                textposition=["top center" if x[i] % 2 == 0 else "bottom center" for i in idx],
                textfont={"family": "monospace", "size": 13, "color": "#222" if kind != "unreached" else "#777"},
                marker={
                    "color": color,
                    "size": [size[i] for i in idx],
                    "symbol": "diamond" if kind == "target" else "circle",
                    "line": {"width": 0},
                },
                customdata=[[probs[i], target_p[i], values[i], x[i], rank[i], head[i]] for i in idx],
                hovertemplate=node_hover(kind, bool(predicted)),
            )
        )
    made = f"copied after a {step.copied_after}-token match" if step.copied_after else "drafted"
    fig.update_layout(
        title=title or f"step {step.step}: {len(step.tokens) - 1} {made}, {len(step.accepted)} accepted",
        # at most about TICKS depth ticks: a 256-node chain's 257 would print over each other
        xaxis={
            "title": "depth (tokens after the root)" + ("; drag to see deeper" if deepest < max(x) else ""),
            "dtick": max(1, math.ceil((deepest + 1) / TICKS)),
            "range": [-0.5, deepest + 0.8],
        },
        yaxis={"visible": False, "range": [leaves - 0.4, -1.0]},  # first leaf at the top; room for its label
        height=tree_height(leaves),
        margin=TREE_MARGIN,
        # in the bottom margin, its symbols at one size however small a dense tree's markers are
        legend={"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom", "itemsizing": "constant"},
    )
    return fig


def text_html(steps, hidden_ids: frozenset[int] = frozenset(), mark: Collection[int] = ()) -> str:
    """The generated text, each token marked by the step that produced it: drafted and accepted
    tokens in green, the target's own token of each step (bonus or correction) in blue; tokens in
    `hidden_ids` (special ones, such as the end of a turn) left out unless marked; the answer's
    tokens at the positions `mark` outlined."""
    parts, position = [], 0
    for s in steps:
        for j, (token, text) in enumerate(zip(s.emitted, s.emitted_texts)):
            position += 1
            if token in hidden_ids and position - 1 not in mark:
                continue
            shown = "⟨end⟩" if token in hidden_ids else text  # the end of the answer, marked: a placeholder
            kind = "drafted" if j < len(s.accepted) else "target"
            what = "drafted and accepted" if kind == "drafted" else "the target's own token"
            outline = ";outline:2px solid #D55E00" if position - 1 in mark else ""
            parts.append(
                f'<span title="step {s.step}: {what}" style="background:{HIGHLIGHT[kind]};white-space:pre-wrap'
                f'{outline}">{html.escape(shown)}</span>'
            )
    return "<div style='font-family:monospace;line-height:1.6'>" + "".join(parts) + "</div>"


CHANGE_GAP = 6  # changes closer than 1/CHANGE_GAP of the run share one label, their last settings


def setting_changes(steps) -> list[tuple[object, float | None]]:
    """The steps whose budget or temperature differ from the step before (settings changed while the
    run went on, `Knobs`), each with the height (a fraction of the plot) of its label, None where a
    later change close to it carries the label: a slider dragged changes them at every step, and
    labels side by side would print over each other. Labels alternate between two heights."""
    changed = [
        s for before, s in zip(steps, steps[1:]) if (before.budget, before.temperature) != (s.budget, s.temperature)
    ]
    gap = max(2, len(steps) / CHANGE_GAP)
    last_of_group = [i + 1 == len(changed) or changed[i + 1].step - s.step >= gap for i, s in enumerate(changed)]
    heights, labelled = [], 0
    for s, last in zip(changed, last_of_group):
        heights.append((s, 0.98 - 0.1 * (labelled % 2)) if last else (s, None))
        labelled += last
    return heights


def steps_figure(steps, running: list[float | None] | None = None) -> go.Figure:
    """Tokens committed per target forward at each step (left axis), and the running speedup over
    `ar` on the same prompt with a line at ar's own speed (right axis; `dyspec.eval.speedup.running_speedup`:
    None until enough tokens are in); a dashed line where the budget or temperature changed."""
    fig = go.Figure()
    xs = [s.step for s in steps]
    fig.add_trace(
        go.Bar(x=xs, y=[len(s.emitted) for s in steps], name="tokens per forward (left)", marker_color="#999999")
    )
    if running and any(r is not None for r in running):
        fig.add_trace(
            go.Scatter(
                x=xs, y=running, name="running speedup vs ar (right)", yaxis="y2", line={"color": "#E69F00", "width": 3}
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[xs[0], xs[-1]],
                y=[1.0, 1.0],
                name="ar: 1.0x (right)",
                yaxis="y2",
                mode="lines",
                line={"color": "#555", "dash": "dot"},
            )
        )
        top = max(2.0, *(r for r in running if r is not None)) * 1.1
        fig.update_layout(
            yaxis2={
                "overlaying": "y",
                "side": "right",
                "title": "speedup vs ar",
                "range": [0, top],
                "tickformat": ".1f",
                "automargin": True,
            }
        )
    for s, label in setting_changes(steps):
        fig.add_vline(x=s.step - 0.5, line={"color": "#0072B2", "dash": "dash"})
        if label is not None:
            fig.add_annotation(
                x=s.step - 0.5,
                y=label,
                yref="paper",
                text=f"budget {s.budget}, T {s.temperature:g}",
                xanchor="left",
                showarrow=False,
                font={"color": "#0072B2"},
                bgcolor="rgba(255,255,255,0.8)",
            )
    fig.update_layout(
        title="Per step",
        xaxis={  # whole steps, and the run's own: labels never widen the axis
            "title": "step",
            "tick0": 0,
            "dtick": max(1, math.ceil(len(steps) / TICKS)),
            "range": [xs[0] - 0.5, xs[-1] + 0.5] if xs else None,
        },
        yaxis={"title": "tokens per forward", "automargin": True, "rangemode": "tozero"},
        height=380,
        # in the bottom margin, below the axis title, however many lines a narrow plot wraps it into
        legend={"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom"},
        margin={"l": 50, "r": 50, "t": 50, "b": 110},
    )
    return fig


def sweep_figure(runs) -> go.Figure:
    """Tokens per target forward against budget, a line per policy, from replayed runs
    (dyspec.decode.replay.ReplayRun)."""
    fig = go.Figure()
    by_policy = defaultdict(list)
    for r in runs:
        by_policy[r.policy].append(r)
    for policy, rs in by_policy.items():
        rs = sorted(rs, key=lambda r: r.budget)
        fig.add_trace(
            go.Scatter(
                x=[r.budget for r in rs], y=[r.tokens_per_forward for r in rs], mode="lines+markers", name=policy
            )
        )
    fig.update_layout(
        title="Tokens per target forward against budget (replayed, T = 0)",
        xaxis={"title": "budget (drafted tokens per step)", "type": "log", "dtick": math.log10(2)},
        yaxis={"title": "tokens per target forward", "rangemode": "tozero"},
        height=360,
        legend={"orientation": "h", "y": -0.25},
        margin={"l": 50, "r": 20, "t": 50, "b": 40},
    )
    return fig
