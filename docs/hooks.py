"""mkdocs hooks: the command-line reference is made from dyspec's argparse parser and the bench
record reference from its JSON schema at build time, so neither can drift from the code; the
home page is README.md and the changelog page CHANGELOG.md; the tutorials are the notebooks,
executed where `make notebooks` (or the test suite) left executed copies in EXECUTED."""

import json
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

from dyspec.cli import build_parser
from dyspec.eval.bench import SCHEMA

ROOT = Path(__file__).resolve().parents[1]
EXECUTED = ROOT / "build" / "notebooks"
STAGED = ROOT / "build" / "docs"


@event_priority(100)  # before mkdocs-jupyter's, which turns the notebooks added here into pages
def on_files(files, config, **kwargs):
    # staged as real files under STAGED: mkdocs-jupyter reads a page's path from its folder
    (STAGED / "tutorials").mkdir(parents=True, exist_ok=True)
    for source in sorted((ROOT / "notebooks").glob("*.ipynb")):
        executed = EXECUTED / source.name
        fresh = executed.is_file() and executed.stat().st_mtime >= source.stat().st_mtime
        book = json.loads((executed if fresh else source).read_text())
        for cell in book["cells"]:
            if cell["cell_type"] == "markdown":
                cell["source"] = site_links("".join(cell["source"]))
        (STAGED / "tutorials" / source.name).write_text(json.dumps(book))
        uri = f"tutorials/{source.name}"
        files.append(File(uri, str(STAGED), config.site_dir, config.use_directory_urls))
    return files


def site_links(markdown: str) -> str:
    """A notebook's links as its page in the site (tutorials/NAME/) reaches their targets: the docs'
    pages and the other notebooks, which JupyterLab opens by their paths in the checkout."""
    markdown = re.sub(r"\]\(\.\./docs/([^)#]+)\.md(#[^)]*)?\)", lambda m: f"](../../{m[1]}/{m[2] or ''})", markdown)
    return re.sub(r"\]\((\d\d_\w+)\.ipynb\)", r"](../\1/)", markdown)


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
