"""`dyspec report`: a results page in Markdown from records, a bench's or a replay sweep's, each
section stamped with how its records were made."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dyspec.auto import whatif
from dyspec.errors import DyspecError
from dyspec.eval import bench, summary, sweep


def results_page(paths: list[Path], title: str, whatif_models: Sequence[whatif.LatencyModel] = ()) -> str:
    """A results page: per records file, its stamp (host, date, versions, pair, command, as the
    records carry them) and its tables: a bench's summary, or a replay sweep's (dyspec.eval.sweep)."""
    parts = [f"# {title}"]
    for path in paths:
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
            tables = [bench.markdown_table(rows, records, whatif_models), bench.auto_table(records, rows)]
        parts += [
            f"## {path.stem}",
            f"Host: {first.get('host', '(not recorded)')}; date: {first.get('date', '(not recorded)')}; {versions}. "
            f"Target `{first['target']}` ({first['precision']}{fast}, {first['device']}), draft `{first['draft']}`. "
            f"Records: `{path.name}`.",
            "\n".join(f"    {c}" for c in commands),
            "\n\n".join(t for t in tables if t),
        ]
    return "\n\n".join(parts) + "\n"
