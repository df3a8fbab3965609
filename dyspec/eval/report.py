"""`dyspec report`: a results page in Markdown from records, a bench's or a replay sweep's, each
section stamped with how its records were made."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dyspec.auto import whatif
from dyspec.auto.profile import profile_table
from dyspec.errors import DyspecError
from dyspec.eval import bench, summary, sweep


def results_page(paths: list[Path], title: str, whatif_models: Sequence[whatif.LatencyModel] = ()) -> str:
    """A results page: per records file, its stamp (host, date, versions, pair, command, as the
    records carry them) and its tables: a bench's summary, or a replay sweep's (dyspec.eval.sweep);
    per latency profile (a .json file from `dyspec profile --json`), its stamp and table."""
    parts = [f"# {title}"]
    for path in paths:
        if path.suffix == ".json":
            parts += profile_section(path)
            continue
        records = bench.read_records(path)
        if not records:
            raise DyspecError(f"{path}: no bench records in it")
        first = records[0]
        versions = ", ".join(f"{k} {v}" for k, v in first["versions"].items())
        commands = sorted({r.get("command") or "(not recorded)" for r in records})
        fast = f", fast path {first.get('fast_path', 'off')}"  # absent in records older than fast paths: off
        if first.get("kind") == sweep.KIND:
            tables = [sweep.REPLAY_NOTE, sweep.sweep_table(sweep.sweep_rows(records, whatif_models))]
        else:
            rows = summary.summarize(records)
            tables = [
                bench.markdown_table(rows, records, whatif_models),
                bench.auto_table(records, rows),
                bench.identity_table(records),
            ]
        parts += [
            f"## {path.stem}",
            f"Host: {first.get('host', '(not recorded)')}; date: {first.get('date', '(not recorded)')}; {versions}. "
            f"Target `{first['target']}` ({first['precision']}{fast}, {first['device']}), draft `{first['draft']}`. "
            f"Records: `{path.name}`.",
            "\n".join(f"    {c}" for c in commands),
            "\n\n".join(t for t in tables if t),
        ]
    return "\n\n".join(parts) + "\n"


def profile_section(path: Path) -> list[str]:
    """A latency profile's section of a results page: its stamp and `profile_table`."""
    try:
        profile = json.loads(path.read_text())
        table = profile_table(profile)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DyspecError(f"{path}: not a latency profile from `dyspec profile --json` ({e})") from None
    versions = ", ".join(f"{k} {v}" for k, v in profile.get("versions", {}).items())
    return [
        f"## {path.stem}",
        f"Host: {profile.get('host', '(not recorded)')}; date: {profile.get('date', '(not recorded)')}; {versions}. "
        f"Pair: {profile.get('pair', '(not recorded)')}. Profile: `{path.name}`.",
        f"    {profile.get('command') or '(not recorded)'}",
        "```\n" + table + "\n```",
    ]
