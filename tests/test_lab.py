"""The dashboard in real JupyterLab, in headless Debian Chromium, pressed as a participant presses it:
Run redraws every figure. With DYSPEC_SCREENSHOTS=docs it also makes docs/lab.png."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_app import CHROMIUM, screenshot

ROOT = Path(__file__).resolve().parents[1]
CELL = """\
import dyspec
from widgets import Dashboard

pair = dyspec.load_pair()
dash = Dashboard(pair)
dash.max_new_tokens.value = 32
dash"""
FINISHED = "text=/Done \\((the token limit|the answer ended)\\)/"  # the stats once a run is over


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on a folder holding one notebook with the dashboard (127.0.0.1, a free port, no
    token); its URL."""
    book = {"cells": [{"cell_type": "code", "metadata": {}, "source": CELL, "outputs": [], "execution_count": None}]}
    book |= {"metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}}, "nbformat": 4}
    (tmp_path / "dash.ipynb").write_text(json.dumps(book | {"nbformat_minor": 5}))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("jupyter")),
            "lab",
            "--no-browser",
            f"--port={port}",
            "--ServerApp.ip=127.0.0.1",
            "--IdentityProvider.token=",
            "--ServerApp.disable_check_xsrf=True",
            f"--ServerApp.root_dir={tmp_path}",
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        yield f"http://127.0.0.1:{port}/lab/tree/dash.ipynb"
    finally:
        server.terminate()
        server.wait(30)


def figures(page) -> list[str]:
    """Every plotly figure the dashboard shows, as its drawn SVG."""
    plots = page.locator(".jp-OutputArea .js-plotly-plot")
    return plots.evaluate_all("els => els.map(e => e.querySelector('.main-svg').outerHTML)")


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium (.ci/run installs it)")
def test_pressing_run_in_jupyterlab_redraws_every_figure(lab, tmp_path):
    """The button runs in a thread of its own; figures drawn from there once stayed on the last run."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        for _ in range(60):  # the server takes a few seconds to listen
            try:
                page.goto(lab)
                break
            except Exception:
                time.sleep(2)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=180_000)
        try:  # JupyterLab's "get news?" toast would cover the figures
            page.get_by_role("button", name="No", exact=True).click(timeout=5_000)
        except PlaywrightTimeout:
            pass
        # a key pressed before the editor takes focus (late on a loaded machine) is lost: press again
        # until the first cell's prompt says it ran or runs ("[*]", "[1]")
        started = "/\\[(\\*|\\d+)\\]/.test(document.querySelector('.jp-Cell .jp-InputPrompt').textContent)"
        for _ in range(10):
            page.locator(".jp-Cell .jp-InputArea-editor").first.click()
            page.keyboard.press("Shift+Enter")
            try:
                page.wait_for_function(started, timeout=15_000)
                break
            except PlaywrightTimeout:
                continue
        run = page.locator(".jp-OutputArea button", has_text="Run").first
        run.wait_for(timeout=300_000)
        run.click()
        page.wait_for_selector(FINISHED, timeout=300_000)
        drawn = "document.querySelectorAll('.jp-OutputArea .js-plotly-plot').length >= 4"
        page.wait_for_function(drawn, timeout=60_000)
        page.wait_for_timeout(1000)
        first = figures(page)
        page.locator(".jp-OutputArea select").first.select_option(label="Fix a passage")  # another example prompt
        run.click()
        page.wait_for_selector("text=/Measuring ar|Running /", timeout=60_000)  # the new run started
        page.wait_for_selector(FINISHED, timeout=300_000)
        for _ in range(30):  # the refresh after the run draws the figures, each in turn
            second = figures(page)
            if all(a != b for a, b in zip(first, second)):
                break
            page.wait_for_timeout(1000)
        assert len(second) == len(first) >= 4
        same = [i for i, (a, b) in enumerate(zip(first, second)) if a == b]
        assert not same, f"figures {same} still show the last run"
        page.locator(".widget-vbox").first.scroll_into_view_if_needed()
        screenshot(page, tmp_path, "lab.png")
        browser.close()
