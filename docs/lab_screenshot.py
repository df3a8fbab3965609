"""Make docs/lab.png: the quickstart notebook's dashboard in JupyterLab, in headless Chromium.

    .venv/bin/python docs/lab_screenshot.py

Starts JupyterLab on a copy of notebooks/01_quickstart.ipynb (127.0.0.1, a free port, no token, so
the notebook in git is never touched), runs all cells, waits for the dashboard's run to finish, and
saves a screenshot of it.
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    port = free_port()
    work = Path(tempfile.mkdtemp())
    shutil.copy(ROOT / "notebooks" / "01_quickstart.ipynb", work)
    lab = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("jupyter")),
            "lab",
            "--no-browser",
            f"--port={port}",
            "--ServerApp.ip=127.0.0.1",
            "--IdentityProvider.token=",
            "--ServerApp.disable_check_xsrf=True",
            f"--ServerApp.root_dir={work}",
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium")
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            for _ in range(60):  # wait for the server
                time.sleep(2)
                try:
                    page.goto(f"http://127.0.0.1:{port}/lab/tree/01_quickstart.ipynb")
                    break
                except Exception:
                    continue
            page.wait_for_selector(".jp-Notebook", timeout=180_000)
            try:  # the stripped notebook names no kernel, so JupyterLab asks for one
                page.get_by_role("button", name="Select", exact=True).click(timeout=15_000)
            except PlaywrightTimeout:
                pass
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
            try:  # JupyterLab's "get news?" toast would cover the figures
                page.get_by_role("button", name="No", exact=True).click(timeout=5_000)
            except PlaywrightTimeout:
                pass
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_text("Run All Cells", exact=True).click()
            # The third code cell runs the dashboard; its stats line ends with the stop reason.
            page.wait_for_selector("text=/\\((max_new_tokens|eos)\\)/", timeout=300_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=600_000)
            page.locator(".widget-vbox").first.scroll_into_view_if_needed()
            page.wait_for_timeout(2000)
            page.screenshot(path=str(ROOT / "docs" / "lab.png"))
            browser.close()
    finally:
        lab.terminate()
        lab.wait(30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
