"""A run to share: one HTML file that shows a run's settings, text and figures in any browser, with
no server and no network, and carries the run's record (settings, every step's tree and outcome,
`ar`'s steps, the machine it ran on) so that the app or the dashboard loads it back. Loading reads
JSON only and checks it field by field: a shared file is data, never code or a path."""

from __future__ import annotations

import dataclasses
import html
import json
import re
from collections.abc import Sequence

import plotly.graph_objects as go

from dyspec.core.events import GenerationFinished, StepVerified
from dyspec.errors import DyspecError

FORMAT = 1  # the record's layout; a loader refuses any other
RECORD_ID = "dyspec-run"
MAX_BYTES = 64 * 2**20  # a 256-token run with 64-node trees and its plotly.js is far below this
RECORD = re.compile(rf'<script type="application/json" id="{RECORD_ID}">(.*?)</script>', re.S)
NODE_FIELDS = ("tokens", "texts", "parents", "depths", "draft_probs", "values", "target_probs")
NOT_A_RUN = "This file is not a run downloaded from dyspec"


def run_record(
    policy: str,
    options: dict,
    prompt: str,
    steps: Sequence[StepVerified],
    ar: Sequence[StepVerified],
    finished: GenerationFinished | None,
    made_on: str,
) -> dict:
    """Everything a view needs to show a run again, as JSON-ready data."""
    return {
        "dyspec_run": FORMAT,
        "policy": policy,
        "options": options,  # beyond the policy's own defaults (absent in records from before it)
        "prompt": prompt,
        "made_on": made_on,
        "steps": [dataclasses.asdict(s) for s in steps],
        "ar": [dataclasses.asdict(s) for s in ar],
        "finished": finished.to_dict() if finished is not None else None,
    }


def run_page(title: str, sections: Sequence[str], figures: Sequence[go.Figure], record: dict) -> str:
    """A page that stands alone: the HTML `sections`, the figures (plotly.js inlined once, so it
    draws offline) and the record in a JSON script element that `load_record` reads back."""
    plots = [fig.to_html(full_html=False, include_plotlyjs=i == 0) for i, fig in enumerate(figures)]
    data = json.dumps(record).replace("<", "\\u003c")  # the same JSON, and no tag inside the script
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body style='font-family:sans-serif;max-width:1100px;margin:auto'><h1>{html.escape(title)}</h1>"
        + "".join(f"<div>{s}</div>" for s in sections)
        + "".join(plots)
        + f'<script type="application/json" id="{RECORD_ID}">{data}</script></body></html>'
    )


def parse_record(text: str | bytes) -> dict:
    """The record of a downloaded run page (or of its bare JSON), checked; DyspecError otherwise."""
    if len(text) > MAX_BYTES:
        raise DyspecError(f"{NOT_A_RUN}: it is larger than {MAX_BYTES // 2**20} MiB.")
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    found = RECORD.search(text)
    try:
        record = json.loads(found.group(1) if found else text)
    except json.JSONDecodeError:
        raise DyspecError(f"{NOT_A_RUN} (no run record in it).") from None
    if not isinstance(record, dict) or record.get("dyspec_run") != FORMAT:
        raise DyspecError(f"{NOT_A_RUN} (no run record of format {FORMAT} in it).")
    for key, kind in (("policy", str), ("prompt", str), ("made_on", str), ("steps", list), ("ar", list)):
        if not isinstance(record.get(key), kind):
            raise DyspecError(f"{NOT_A_RUN}: its record has no valid {key!r}.")
    options = record.get("options", {})
    if not isinstance(options, dict) or not all(isinstance(v, (str, int, float, bool)) for v in options.values()):
        raise DyspecError(f"{NOT_A_RUN}: its record has no valid 'options'.")
    return record


def steps_from(items: list, name: str) -> list[StepVerified]:
    """Steps of a record, each checked so that a view can draw it: the fields a step has, one entry
    per node, every parent before its child, accepted nodes in the tree."""
    fields = {f.name for f in dataclasses.fields(StepVerified)}
    steps = []
    for i, item in enumerate(items):
        where = f"{NOT_A_RUN}: step {i} of its {name!r}"
        if not isinstance(item, dict) or not set(item) <= fields:
            raise DyspecError(f"{where} has unknown fields.")
        try:
            step = StepVerified(**item)
        except TypeError as e:
            raise DyspecError(f"{where} is incomplete ({e}).") from None
        nodes = [getattr(step, f) for f in NODE_FIELDS]
        if not all(isinstance(v, list) and len(v) == len(step.tokens) for v in nodes) or not step.tokens:
            raise DyspecError(f"{where} has node lists of different lengths.")
        ints = [*step.tokens, *step.parents, *step.depths, *step.accepted, *step.emitted]
        numbers = [*step.draft_probs, *step.values, *step.target_probs, step.draft_s, step.target_s, step.overhead_s]
        texts = [*step.texts, *step.emitted_texts]
        if (
            not all(isinstance(v, int) for v in ints)
            or not all(isinstance(v, int | float) for v in numbers)
            or not all(isinstance(t, str) for t in texts)
            or len(step.emitted_texts) != len(step.emitted)
        ):
            raise DyspecError(f"{where} has values of the wrong kind.")
        if any(not 0 <= p < j for j, p in enumerate(step.parents[1:], start=1)) or any(
            not 0 < a < len(step.tokens) for a in step.accepted
        ):
            raise DyspecError(f"{where} is not a tree.")
        steps.append(step)
    return steps


def finished_from(item: dict | None) -> GenerationFinished | None:
    if item is None:
        return None
    try:
        return GenerationFinished(**item)
    except TypeError:
        raise DyspecError(f"{NOT_A_RUN}: its end of generation is not one dyspec writes.") from None
