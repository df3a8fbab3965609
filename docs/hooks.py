"""mkdocs hooks: the command-line reference is made from dyspec's argparse parser and the bench
record reference from its JSON schema at build time, so neither can drift from the code; the
home page is README.md and the changelog page CHANGELOG.md."""

import json
from pathlib import Path

from dyspec.cli import build_parser
from dyspec.eval.bench import SCHEMA

ROOT = Path(__file__).resolve().parents[1]


def cli_reference() -> str:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.choices and isinstance(a.choices, dict)]
    parts = []
    for name, command in sub.choices.items():
        parts.append(f"## dyspec {name}\n\n```text\n{command.format_help()}```\n")
    return "\n".join(parts)


def records_reference() -> str:
    rows = ["| field | type | required | description |", "|---|---|---|---|"]
    for name, spec in SCHEMA["properties"].items():
        kind = spec.get("type") or " or ".join(json.dumps(o.get("type", o.get("const"))) for o in spec.get("oneOf", []))
        kind = " or ".join(kind) if isinstance(kind, list) else kind
        required = "yes" if name in SCHEMA["required"] else ""
        rows.append(f"| `{name}` | {kind} | {required} | {spec.get('description', '')} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri == "reference/cli.md":
        return markdown.replace("{{ cli }}", cli_reference())
    if page.file.src_uri == "reference/records.md":
        return markdown.replace("{{ records }}", records_reference())
    if page.file.src_uri == "index.md":  # the README, its links made relative to docs/
        readme = (ROOT / "README.md").read_text().replace("](docs/", "](")
        return readme.replace("](CHANGELOG.md)", "](changelog.md)")
    if page.file.src_uri == "changelog.md":
        return (ROOT / "CHANGELOG.md").read_text()
    return markdown
