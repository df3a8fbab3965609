"""The documentation: the site builds strictly (broken links and missing pages fail), the reference
covers every subcommand and public name, the README stays short, and the docs speak of the tool,
not of its development."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dyspec
from dyspec.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).with_name("mkdocs")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run(
        [str(MKDOCS), "build", "--strict", "-d", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def subcommands() -> list[str]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a.choices, dict)]
    return list(sub.choices)


def test_reference_covers_every_subcommand_and_public_name(site):
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for name in subcommands():
        assert f'id="dyspec-{name}"' in cli, name
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in dyspec.__all__:
        assert f'id="dyspec.{name}"' in api, name
    records = (site / "reference" / "records" / "index.html").read_text()
    assert "step_shapes" in records and "tokens_per_forward" in records


def test_every_notebook_is_a_tutorial_page(site):
    """The six notebooks render as pages (executed where the suite or `make notebooks` ran them), and
    their relative links (the glossary, the next notebook) reach a page of the site."""
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        folder = site / "tutorials" / notebook.stem
        page = (folder / "index.html").read_text()
        assert "import dyspec" in page, notebook.name
        links = re.findall(r'<a href="(\.\./[^"#]*)', page)
        assert links, notebook.name
        for link in links:
            assert (folder / link / "index.html").resolve().is_file(), (notebook.name, link)


def test_notebook_links_reach_files_in_the_checkout():
    """As JupyterLab opens them: relative to the notebooks' folder."""
    found = 0
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(notebook.read_text())["cells"]:
            for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", "".join(cell["source"])):
                found += 1
                assert (notebook.parent / link).is_file(), (notebook.name, link)
    assert found >= 7  # the glossary from the first two, each notebook's next but the last


def test_home_is_the_readme_and_it_is_short(site):
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "Install and run" in (site / "index.html").read_text()


# results pages carry run stamps, the changelog version dates; nothing else speaks of when or how
# the project was developed
STAMPED = {"results", "changelog.md"}
HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bsessions?\b|(?<![\w/])#\d+\b", re.IGNORECASE)


def test_docs_speak_of_the_tool_not_its_development():
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    found = []
    for page in pages:
        if page.relative_to(ROOT / "docs" if page.is_relative_to(ROOT / "docs") else ROOT).parts[0] in STAMPED:
            continue
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{page.relative_to(ROOT)}:{number}: {line.strip()[:80]}")
    assert not found, "\n".join(found)


def test_the_license_text_ships_at_the_root_and_in_the_wheel():
    """Apache-2.0's text in LICENSE, which the package's metadata names for its wheel."""
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    project = (ROOT / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in project and 'license-files = ["LICENSE"]' in project
