"""Make docs/site-home.png and docs/site-guide.png: the built docs site in headless Chromium.

    .venv/bin/mkdocs build --strict && .venv/bin/python docs/site_screenshots.py

Serves site/ on 127.0.0.1 at a free port and saves the home page and the serving-engine guide.
"""

import functools
import http.server
import socket
import threading
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"site-home.png": "", "site-guide.png": "guide/serving/"}


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(ROOT / "site"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium")
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        for name, path in PAGES.items():
            page.goto(f"http://127.0.0.1:{port}/{path}")
            page.wait_for_load_state("networkidle")
            page.screenshot(path=ROOT / "docs" / name)
        browser.close()
    server.shutdown()


if __name__ == "__main__":
    main()
