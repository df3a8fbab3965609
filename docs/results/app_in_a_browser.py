"""The live tab's measured speedup as a presenter gets it: the app and a real browser (headless
Debian Chromium) on the same machine, "A list" run with the default policy, `ar` measured before
each run, for each `--threads` given. Writes one JSON line per run (`cpu-app-threads-browser.jsonl`)
and prints a table.

    .venv/bin/python docs/results/app_in_a_browser.py --threads 2,default --runs 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests
from playwright.sync_api import expect, sync_playwright

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("cpu-app-threads-browser.jsonl")


def start_app(threads: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = [] if threads == "default" else ["--threads", threads]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "app.py"), "--port", str(port), *extra],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/"
    for _ in range(600):
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            time.sleep(1)
    proc.kill()
    raise SystemExit("the app did not start")


def live_runs(url: str, runs: int) -> list[dict]:
    """Each run's speedup, `ar`'s rate and the machine line, as the stats show them."""
    out = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(url)
        expect(page.locator("#sbs-table")).to_contain_text("ar (baseline)", timeout=300_000)
        expect(page.locator("#sbs-sweep .main-svg").first).to_be_visible(timeout=300_000)  # the page settled
        header = page.locator("h1").locator("xpath=..").inner_text()
        page.get_by_role("tab", name="Generate (live, measured)").click()
        page.locator("#examples").get_by_text("A list", exact=True).click()
        for _ in range(runs):
            page.locator("#run").click()
            expect(page.locator("#stats")).to_contain_text("Measuring ar", timeout=60_000)
            expect(page.locator("#stats")).to_contain_text("Done", timeout=120_000)
            stats = page.locator("#stats").inner_text()
            speedup = re.search(r"on this machine: ([\d.]+)x", stats)
            ar = re.search(r"plain decoding, ([\d.]+) tokens/s", stats)
            out.append({"speedup": float(speedup.group(1)), "ar_tokens_per_s": float(ar.group(1)), "page": header})
            time.sleep(2)
        browser.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="2,default", help="comma-separated: a count, or 'default'")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    command = shlex.join(["python", "docs/results/app_in_a_browser.py", *sys.argv[1:]])
    records = []
    for threads in args.threads.split(","):
        proc, url = start_app(threads)
        try:
            for run in live_runs(url, args.runs):
                machine = re.search(r"draft `?[^,]+`?, (cpu[^.]*)\.", run.pop("page").replace("\n", " "))
                records.append({"threads": threads, **run, "machine": machine.group(1) if machine else None})
        finally:
            proc.terminate()
            proc.wait(30)
    stamp = {"date": datetime.date.today().isoformat(), "command": command}
    OUT.write_text("".join(json.dumps(r | stamp) + "\n" for r in records))
    print("| --threads | app's machine line | runs | speedup vs ar (median, range) | ar tokens/s (median) |")
    print("|---|---|---|---|---|")
    for threads in args.threads.split(","):
        mine = [r for r in records if r["threads"] == threads]
        s = [r["speedup"] for r in mine]
        ar = statistics.median(r["ar_tokens_per_s"] for r in mine)
        print(
            f"| {threads} | {mine[0]['machine']} | {len(s)} | {statistics.median(s):.2f}x ({min(s):.2f}-{max(s):.2f}) "
            f"| {ar:.0f} |"
        )


if __name__ == "__main__":
    main()
