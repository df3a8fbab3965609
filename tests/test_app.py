"""The web app as users meet it: a real server, real headless Chromium, real API clients."""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests
import torch

from dyspec.defaults import defaults_for, options_text
from dyspec.views.examples import EXAMPLES
from dyspec.views.state import SIDE_BY_SIDE_BUDGET, STOP_REASONS

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The app, its operator's log in `proc.log` (a file, read while it runs)."""
    port = free_port()
    log = tmp_path_factory.mktemp("app") / "app.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "app.py"), "--port", str(port)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    proc.log = log
    url = f"http://127.0.0.1:{port}/"
    # a fresh machine compiles the int8 forward before the app's warm-up generations: about 45 s
    # alone, longer beside another test worker
    deadline = time.time() + 420
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"app exited: {log.read_text()}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            time.sleep(1)
    else:
        proc.kill()
        pytest.fail("app did not start in time")
    yield url, proc
    proc.terminate()
    proc.wait(30)


def test_the_models_leave_a_core_to_the_browser_on_a_cpu(server):
    """On a CPU the app runs its forwards on one thread fewer than torch would (its browser shares
    the cores), says so in the page's header, and takes a count the operator gives."""
    sys.path.insert(0, str(ROOT))
    import app
    from dyspec.errors import DyspecError
    from dyspec.forward import thread

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert app.model_threads(cpu, None) == max(1, thread.threads() - 1)
    assert app.model_threads(cuda, None) is None and app.model_threads(cpu, 3) == 3
    with pytest.raises(DyspecError, match="at least 1"):
        app.model_threads(cpu, 0)
    url, _ = server
    cores, n = os.cpu_count(), max(1, int(os.environ["OMP_NUM_THREADS"]) - 1)  # the suite's count, less one
    assert f"cpu, {n} thread{'s' * (n > 1)} of {cores} cores" in requests.get(url, timeout=30).text


def test_binds_to_localhost_only(server):
    url, proc = server
    ports = [c.laddr for c in psutil.Process(proc.pid).net_connections() if c.status == psutil.CONN_LISTEN]
    assert ports and all(addr.ip == "127.0.0.1" for addr in ports)


def test_api_with_gradio_client(server, tmp_path):
    from gradio_client import Client, handle_file

    url, _ = server
    client = Client(url, verbose=False)
    whatif = ("h100", 64, 0.1)  # the what-if menu: hardware, parametric width and draft fraction
    text, tree, chart, depth, stats, *_ = client.predict(
        "Name three colors.", "chain", 4, False, 0, 0, 12, False, *whatif, api_name="/run"
    )
    assert "12 tokens" in stats and "per forward" in stats
    assert "<span" in text and "Acceptance by tree depth" in str(depth)
    run_text, *_, whatif_line, download = client.predict(
        "Name three colors.", "dyspec", 4, True, 0, 0, 12, True, *whatif, api_name="/run"
    )
    assert "Measured on this machine" in whatif_line and "Modelled on H100" in whatif_line
    page = Path(download["value"] if isinstance(download, dict) else download).read_text()
    assert "dyspec-run" in page and "Name three colors." in page  # the run to share
    shared = handle_file(download["value"] if isinstance(download, dict) else download)
    loaded = client.predict(shared, *whatif, api_name="/load_run")
    loaded_text, loaded_stats = loaded[0], loaded[4]
    assert loaded_text == run_text  # the same text, its featured step outlined
    # and the controls it ran with (policy, auto, temperature, seed, length), so the next Run runs it
    prompt, policy, _, auto, temperature, seed, length = loaded[-7:]
    assert (prompt, policy, auto, temperature, seed, length) == ("Name three colors.", "dyspec", True, 0, 0, 12)
    assert "on the machine it ran on" in loaded_stats
    not_a_run = tmp_path / "notes.html"
    not_a_run.write_text("<html><body>my notes</body></html>")
    with pytest.raises(Exception, match="not a run downloaded from dyspec"):  # an error, not blank outputs
        client.predict(handle_file(str(not_a_run)), *whatif, api_name="/load_run")
    board = client.predict("Name three colors.", "chain", 4, 12, "0.5", *whatif, api_name="/race")  # no State
    # 12 tokens at most: too few for a speedup, as the live tab says (the browser's race measures 48)
    assert board.count("· done") == 2 and "too few for a speedup" in board and "measured on" not in board
    # the side-by-side tab: its table and trees, then its sweep, each an endpoint returning what it shows
    table, position, answer, *trees, waiting = client.predict(
        "Name three colors.", ["chain", "dyspec"], 4, 12, *whatif, api_name="/side_by_side"
    )
    assert "| chain" in table and "| dyspec" in table and "<span" in answer and position["value"] == 0
    assert [t.get("visible") for t in trees] == [True, True, False, False]  # two policies, two trees
    status, sweep = client.predict("Name three colors.", ["chain", "dyspec"], 12, api_name="/sweep")
    assert status == "" and "against budget" in sweep["plot"]
    exported = client.predict("trtllm", api_name="/export")  # the client's session holds its last run
    assert "max_draft_len" in exported and "max_total_draft_tokens" in exported
    with pytest.raises(Exception, match="maximum value 64"):
        client.predict("hi", "chain", 999, False, 0, 0, 12, False, *whatif, api_name="/run")
    with pytest.raises(Exception, match="Type a prompt"):
        client.predict("   ", "chain", 4, False, 0, 0, 12, False, *whatif, api_name="/run")
    with pytest.raises(Exception, match="at most 4"):
        client.predict(
            "hi", ["chain", "specinfer", "sequoia", "dyspec", "eagle2"], 8, 8, *whatif, api_name="/side_by_side"
        )


def test_api_names_every_input_and_output(server):
    """A client reads names, not `param_5` or `value_60`; a Radio's choices are documented as strings."""
    from gradio_client import Client

    url, _ = server
    info = Client(url, verbose=False).view_api(return_format="dict", print_info=False)["named_endpoints"]
    assert set(info) == {"/side_by_side", "/sweep", "/run", "/load_run", "/race", "/export"}
    for name, endpoint in info.items():
        for item in endpoint["parameters"] + endpoint["returns"]:
            label = item.get("parameter_name") or item["label"]
            assert not re.fullmatch(r"(param|value)_\d+", label), f"{name}: {label}"
    pace = next(p for p in info["/race"]["parameters"] if p["parameter_name"] == "pace")
    assert pace["python_type"]["type"].startswith("Literal['1.0'")


def test_concurrent_clients_match_single_run_and_memory_settles(server):
    from gradio_client import Client

    url, proc = server
    args = ("Write a haiku about rain.", "dyspec", 8, False, 0.8, 7, 32, False, "h100", 64, 0.1)
    single = Client(url, verbose=False).predict(*args, api_name="/run")[0]
    rss_before = psutil.Process(proc.pid).memory_info().rss
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: Client(url, verbose=False).predict(*args, api_name="/run")[0], range(8)))
    assert results == [single] * 8
    time.sleep(2)
    growth = psutil.Process(proc.pid).memory_info().rss - rss_before
    assert growth < 300 * 2**20, f"app memory grew by {growth / 2**20:.0f} MiB after 8 clients"


STATS_TEXT = "#stats [data-testid='markdown']"  # the stats without Gradio's progress overlay


def screenshot(page, tmp_path, name: str, full_page: bool = True) -> None:
    """A screenshot of the page (or of what the window shows); into DYSPEC_SCREENSHOTS (a folder,
    e.g. docs) when set."""
    page.wait_for_timeout(1000)  # plotly's last redraw
    page.screenshot(path=str(tmp_path / name), full_page=full_page)
    if folder := os.environ.get("DYSPEC_SCREENSHOTS"):
        shutil.copy(tmp_path / name, Path(folder) / name)


PROJECTOR = {"width": 1280, "height": 720}


def on_a_projector(page, tmp_path, name: str, button: str, result: str) -> None:
    """At a projector's 1280x720, scrolled to the top: the tab's button and the result it fills are
    both on screen, and no plot is taller than the window; a screenshot of what the room sees."""
    page.set_viewport_size(PROJECTOR)
    page.evaluate("window.scrollTo(0, 0)")
    page.wait_for_timeout(500)
    pressed, shown = page.locator(button).bounding_box(), page.locator(result).bounding_box()
    assert pressed["y"] + pressed["height"] <= PROJECTOR["height"], pressed
    assert shown["y"] + 40 <= PROJECTOR["height"], shown  # its first lines at least
    for plot in page.locator(".js-plotly-plot").all():
        if plot.is_visible():
            assert plot.bounding_box()["height"] <= PROJECTOR["height"] - 100
    screenshot(page, tmp_path, name, full_page=False)


@pytest.fixture
def page(server):
    from playwright.sync_api import sync_playwright

    url, _ = server
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.goto(url)
        yield page
        browser.close()


def tree_branches(page, elem_id: str) -> int:
    """How many drafted nodes in the plotted tree have a sibling: > 0 when the tree branches."""
    return page.evaluate(
        """(id) => {
            const plot = document.querySelector(`#${id} .js-plotly-plot`);
            const edges = plot.data.filter(t => t.mode === 'lines').flatMap(t => {
                const out = [];
                for (let i = 0; i + 1 < t.x.length; i += 3) out.push(`${t.x[i]},${t.y[i]}`);
                return out;
            });
            const counts = {};
            edges.forEach(e => counts[e] = (counts[e] || 0) + 1);
            return Object.values(counts).filter(c => c > 1).length;
        }""",
        elem_id,
    )


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium (.ci/run installs it)")
def test_browser_side_by_side(page, tmp_path):
    """The first tab and its first run: the opening comparison's trees side by side, branching, with
    the baseline row and a sweep chart; moving along the answer redraws every tree."""
    from playwright.sync_api import expect

    expect(page.locator("#sbs-run")).to_be_visible()
    # the page opens on the opening comparison, no click needed
    expect(page.locator("#sbs-table")).to_contain_text("ar (baseline)", timeout=120_000)
    expect(page.locator("#sbs-tree-0 .main-svg").first).to_be_visible(timeout=60_000)
    page.locator("#sbs-examples").get_by_text("A list", exact=True).click()
    boxes = page.locator("#sbs-policies")
    for policy in ("chain", "sequoia", "dyspec", "specinfer"):  # every box unticked, then the three ticked
        boxes.get_by_label(policy, exact=True).uncheck()
    for policy in ("chain", "sequoia", "dyspec", "specinfer", "eagle2"):
        boxes.get_by_label(policy, exact=True).check()
    expect(page.get_by_text("Pick at most 4 policies.").first).to_be_visible(timeout=30_000)  # at once
    for policy in ("specinfer", "eagle2"):
        boxes.get_by_label(policy, exact=True).uncheck()
    page.locator(".toast-close").first.click()
    page.locator("#sbs-run").click()
    table = page.locator("#sbs-table")
    expect(table).to_contain_text("ar (baseline)", timeout=180_000)
    # headers wrap between words, never inside one ("budget" whole)
    for th in table.locator("th").all():
        assert th.evaluate("e => [getComputedStyle(e).wordBreak, getComputedStyle(e).overflowWrap]") == ["normal"] * 2
    cells = [row.locator("td").all_inner_texts() for row in table.locator("tr").all()]
    rows = {c[0].strip(): (c[3].strip(), c[4].strip()) for c in cells if c}  # tokens a forward, draft forwards
    nodes = {c[0].strip(): float(c[2]) for c in cells if c}  # drafted nodes per tree: a budget is a cap
    assert nodes["ar (baseline)"] == 0 and all(0 < nodes[p] <= SIDE_BY_SIDE_BUDGET for p in ("chain", "dyspec"))
    assert len({rows[p] for p in ("chain", "sequoia", "dyspec")}) == 3, rows  # three runs, each its own
    expect(table).to_contain_text("modelled on H100")
    expect(table).to_contain_text("not measured")
    for i in range(3):  # drawn after the table: seconds on a busy machine
        expect(page.locator(f"#sbs-tree-{i} .main-svg").first).to_be_visible(timeout=60_000)
    expect(page.locator("#sbs-tree-3")).to_be_hidden()
    assert tree_branches(page, "sbs-tree-2") > 0  # dyspec's tree branches
    # two trees a row, as a projector shows them
    first, second = (page.locator(f"#sbs-tree-{i}").bounding_box() for i in (0, 1))
    assert abs(first["y"] - second["y"]) < 5 and second["x"] > first["x"] + first["width"] / 2
    # a typed position moves every tree to the step that drafted it, and outlines its token in the answer
    expect(page.locator("#sbs-answer span")).not_to_have_count(0)
    titles = [page.locator(f"#sbs-tree-{i} .gtitle").text_content() for i in range(3)]
    assert all(t.endswith("step 0") for t in titles), titles
    last = page.locator("#sbs-position input[type=number]").get_attribute("max")
    page.locator("#sbs-position input[type=number]").fill(last)
    page.locator("#sbs-position input[type=number]").press("Enter")
    expect(page.locator("#sbs-tree-2 .gtitle")).not_to_have_text(titles[2], timeout=120_000)
    expect(page.locator("#sbs-answer span[style*='outline']")).to_have_count(1)
    # a position typed past the end is the last token: the slider shows it, no output shows an error
    page.locator("#sbs-position input[type=number]").fill(str(int(last) + 7))
    page.locator("#sbs-position input[type=number]").press("Enter")
    expect(page.locator("#sbs-position input[type=number]")).to_have_value(last, timeout=30_000)
    for elem in ("sbs-answer", *(f"sbs-tree-{i}" for i in range(3))):
        expect(page.locator(f"#{elem}")).not_to_contain_text("Error")
    expect(page.locator("#sbs-tree-2 .gtitle")).not_to_have_text(titles[2])
    expect(page.locator("#sbs-sweep .main-svg").first).to_be_visible(timeout=180_000)
    expect(page.locator("#sbs-sweep")).to_contain_text("against budget")
    expect(page.locator("#sbs-sweep-status")).not_to_contain_text("Replaying")  # said while it waited, then gone
    # another accelerator reprices the same trees at once, without a replay
    page.locator("#sbs-hardware input").click()
    expect(page.get_by_role("option", name="H100, 8B target", exact=True)).to_be_visible()  # names, not file names
    expect(page.get_by_role("option", name="h100-8b")).to_have_count(0)
    page.get_by_role("option", name="this machine (measured here)", exact=True).click()
    expect(table).to_contain_text("modelled on this machine", timeout=30_000)
    expect(table).not_to_contain_text("modelled on H100")
    page.get_by_text("What each policy does").click()
    expect(page.locator("#sbs-policy-lines")).to_contain_text("DySpec: grows the tree")
    page.get_by_text("Glossary: the words this page uses").click()  # the docs' glossary, offline
    for term in ("Tokens per forward.", "Path value.", "90% interval over steps."):
        expect(page.locator("#glossary")).to_contain_text(term)
    page.get_by_text("Glossary: the words this page uses").click()
    on_a_projector(page, tmp_path, "app-side-by-side-720.png", "#sbs-run", "#sbs-table")
    # the table fits its column there: its last column, the one a presenter reads out, is not cut off
    overflow = page.evaluate(
        "() => { const box = (q) => document.querySelector(q).getBoundingClientRect();"
        " return box('#sbs-table table').right - box('#sbs-table').right; }"
    )
    assert overflow <= 1, overflow
    screenshot(page, tmp_path, "app-side-by-side.png")
    # big trees stay readable: at budget 128 (kept from the sweep) labels do not print over each other
    page.locator("#sbs-position input[type=number]").fill("0")
    page.locator("#sbs-position input[type=number]").press("Enter")
    page.locator("#sbs-budget input[type=number]").fill("128")
    page.locator("#sbs-run").click()
    expect(page.locator("#sbs-tree-2 .gtitle")).to_contain_text("dyspec at 128", timeout=60_000)
    for i in range(3):
        assert label_overlaps(page, f"sbs-tree-{i}") == 0, i


def label_overlaps(page, elem_id: str) -> int:
    """Pairs of token labels in a plotted tree whose boxes overlap by more than a third of the smaller."""
    return page.evaluate(
        """(id) => {
            const boxes = [...document.querySelectorAll(`#${id} .textpoint text`)]
                .filter(t => t.textContent.trim()).map(t => t.getBoundingClientRect());
            let n = 0;
            for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
                const a = boxes[i], b = boxes[j];
                const w = Math.min(a.right, b.right) - Math.max(a.left, b.left);
                const h = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
                if (w > 0 && h > 0 && w * h > Math.min(a.width * a.height, b.width * b.height) / 3) n++;
            }
            return n;
        }""",
        elem_id,
    )


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium (.ci/run installs it)")
def test_browser_run_and_stop(server, page, tmp_path):
    from playwright.sync_api import expect

    _, proc = server
    page.get_by_role("tab", name="Generate (live, measured)").click()
    page.locator("#prompt textarea").fill("")
    expect(page.locator("#expect textarea")).to_have_value("")  # what to expect of an example goes with it
    page.locator("#run").click()  # a user's mistake: a toast, no badge over the outputs, no traceback
    expect(page.get_by_text("Type a prompt first.").first).to_be_visible(timeout=30_000)
    expect(page.locator("#stats .error, #tree .error, #text .error")).to_have_count(0)
    screenshot(page, tmp_path, "app-error.png")
    assert "Type a prompt first." not in proc.log.read_text()  # the user's mistake is not the operator's
    page.locator(".toast-close").first.click()

    page.locator("#examples").get_by_text(
        "A list", exact=True
    ).click()  # an example fills the prompt and what to expect
    expect(page.locator("#prompt textarea")).to_have_value(EXAMPLES[0].prompt)
    expect(page.locator("#expect textarea")).to_have_value(EXAMPLES[0].expect)
    page.locator("#max-new input[type=number]").fill("32")  # the target's list ends at 33 tokens
    page.locator("#auto input").check()  # budget auto, sized by the cost model
    page.locator("#run").click()
    expect(page.locator("#stats")).to_contain_text("32 tokens", timeout=120_000)
    expect(page.locator("#stats")).to_contain_text("Measured speedup vs ar")
    expect(page.locator("#stats")).to_contain_text("at budget auto")
    expect(page.locator("#stats")).to_contain_text("auto drafted")  # which sizes auto chose
    expect(page.locator("#budget input[type=number]")).to_be_disabled()  # auto sizes the trees
    expect(page.locator("#text span").first).to_be_visible()
    expect(page.locator("#tree .main-svg").first).to_be_visible()
    expect(page.locator("#depth")).to_contain_text("Acceptance by tree depth")
    whatif = page.locator("#whatif")
    expect(whatif).to_contain_text("Measured on this machine", timeout=30_000)
    expect(whatif).to_contain_text("Modelled on")
    expect(page.get_by_label("Parametric: a draft forward's cost, as a fraction of the target's")).to_have_count(0)
    expect(page.locator("#stats")).to_contain_text("accepted the most")  # it opens on its longest path
    on_a_projector(page, tmp_path, "app-720.png", "#run", "#stats")
    screenshot(page, tmp_path, "app.png")

    # a finished run replays at a pace a room can follow: the text grows with the Step slider, to its end
    full, step = page.locator("#text").inner_text(), page.locator("#step input[type=number]")
    last = step.get_attribute("max")
    page.locator("#live-pace").get_by_label("a tenth").check()
    page.locator("#live-replay").click()
    # its first steps' tokens alone (step 0 itself shows for one step's time, too short to poll for)
    expect(page.locator("#text")).not_to_have_text(full, timeout=10_000)
    expect(step).to_have_value(last, timeout=60_000)
    expect(page.locator("#text")).to_have_text(full)
    step.fill("0")
    step.press("Enter")
    expect(page.locator("#tree .gtitle")).to_contain_text("step 0:")
    page.locator("#live-next").click()  # or a step at a time
    expect(step).to_have_value("1", timeout=10_000)
    expect(page.locator("#tree .gtitle")).to_contain_text("step 1:")

    # the run downloads as one page that draws offline, and loads back into the tab
    with page.expect_download() as download:
        page.locator("#download").click()
    saved = tmp_path / "run.html"
    download.value.save_as(saved)
    offline = page.context.browser.new_page()
    offline.route(
        "**/*", lambda route: route.abort() if not route.request.url.startswith("file:") else route.continue_()
    )
    offline.goto(saved.as_uri())
    expect(offline.locator(".main-svg").first).to_be_visible(timeout=30_000)
    assert offline.locator(".plotly-graph-div").count() == 3
    offline.close()
    before = page.locator("#text").inner_text()
    page.locator("#prompt textarea").fill("Something else entirely.")
    with page.expect_file_chooser() as chooser:  # as a user picks the file
        page.locator("#upload").click()
    chooser.value.set_files(str(saved))
    expect(page.locator("#stats")).to_contain_text("on the machine it ran on", timeout=30_000)
    assert page.locator("#text").inner_text() == before
    expect(page.locator("#prompt textarea")).to_have_value(EXAMPLES[0].prompt)  # the loaded run's own prompt
    expect(page.locator("#tree .main-svg").first).to_be_visible()
    screenshot(page, tmp_path, "app-loaded-run.png")
    with page.expect_file_chooser() as chooser:
        page.locator("#upload").click()
    chooser.value.set_files(files=[{"name": "notes.html", "mimeType": "text/html", "buffer": b"<html>my notes</html>"}])
    expect(page.get_by_text("This file is not a run downloaded from dyspec").first).to_be_visible(timeout=30_000)
    expect(page.locator("#stats .error, #tree .error, #text .error")).to_have_count(0)  # a toast, no badge
    assert page.locator("#text").inner_text() == before  # and what is on screen stays
    page.locator(".toast-close").first.click()

    # the run's tree shape, ready for a serving engine: TensorRT-LLM's dynamic tree that covers it
    page.get_by_text("Export this run's tree to a serving engine").click()
    page.locator("#export").click()
    snippet = page.locator("#snippet")
    expect(snippet).to_contain_text("Eagle3DecodingConfig(max_draft_len=", timeout=30_000)
    settings = dict(kv.split("=") for kv in snippet.inner_text().split("Eagle3DecodingConfig(")[1].split(", "))
    depth, total = int(settings["max_draft_len"]), int(settings["max_total_draft_tokens"])
    assert settings["use_dynamic_tree"] == "True" and depth <= total <= int(settings["dynamic_tree_max_topK"]) * depth

    # Stop once the new run streams: the first run's stats read "tokens in" too, and matching them
    # clicked Stop while the app still measured `ar` (a flaky failure on a busy machine)
    stale = page.locator(STATS_TEXT).first.inner_text()
    page.locator("#prompt textarea").fill("Write a long story about a dragon who learns to cook.")
    page.locator("#max-new input[type=number]").fill("256")
    # a slow setting (dyspec's widest trees on a CPU), so that Stop lands mid-run on a busy machine too
    page.locator("#auto input").uncheck()
    page.locator("#policy input").click()
    page.get_by_role("option", name="dyspec", exact=True).click()
    page.locator("#budget input[type=number]").fill("64")
    page.locator("#run").click()
    expect(page.locator("#stats")).to_contain_text("Measuring ar (plain decoding)", timeout=60_000)  # not silent
    page.wait_for_function(
        "([sel, old]) => { const t = document.querySelector(sel)?.innerText ?? ''; "
        "return t.includes('tokens in') && t !== old; }",
        arg=[STATS_TEXT, stale],
        timeout=120_000,
    )
    page.locator("#stop").click()
    # the run ends cleanly after its step: it says so, and its text, tree and chart stay, no error badge
    expect(page.locator("#stats")).to_contain_text("Done (stopped)", timeout=30_000)
    stopped = page.locator("#stats").inner_text()
    time.sleep(3)
    assert page.locator("#stats").inner_text() == stopped  # nothing streams after Stop
    assert "256 tokens" not in stopped
    expect(page.locator(".error")).to_have_count(0)
    expect(page.locator("#tree .main-svg").first).to_be_visible()
    expect(page.locator("#chart .main-svg").first).to_be_visible()
    expect(page.locator("#text span").first).to_be_visible()


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium (.ci/run installs it)")
def test_browser_budget_and_temperature_act_on_a_running_generation(page, tmp_path):
    """Budget 16 to 2 while a long answer streams: the next trees have at most 2 drafted nodes, the
    stats say from which step, and the chart marks it."""
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Generate (live, measured)").click()
    page.locator("#prompt textarea").fill("Write a long story about a dragon who learns to cook.")
    page.locator("#policy input").click()
    page.get_by_role("option", name="dyspec", exact=True).click()
    page.locator("#budget input[type=number]").fill("16")
    page.locator("#max-new input[type=number]").fill("256")
    page.get_by_label("Measure ar on the same prompt (for the speedup)").uncheck()
    page.locator("#run").click()
    expect(page.locator("#stats")).to_contain_text("dyspec at budget 16, temperature 0", timeout=120_000)
    page.locator("#budget input[type=number]").fill("2")
    page.locator("#budget input[type=number]").press("Tab")
    expect(page.locator("#stats")).to_contain_text("dyspec at budget 2, temperature 0", timeout=60_000)
    expect(page.locator("#stats")).to_contain_text("changed while it ran, from step")
    # Stop only ends it sooner: on a busy machine the run may reach its end first (the Stop test
    # above checks Stop itself)
    page.locator("#stop").click()
    ended = "|".join(STOP_REASONS[why] for why in ("stopped", "max_new_tokens"))
    expect(page.locator("#stats")).to_contain_text(re.compile(rf"Done \(({ended})\)"), timeout=60_000)
    expect(page.locator("#chart")).to_contain_text("budget 2, T 0", timeout=30_000)
    expect(page.locator(".error")).to_have_count(0)
    screenshot(page, tmp_path, "app-live-knobs.png")


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium (.ci/run installs it)")
def test_browser_a_run_behind_another_says_it_waits(server, page):
    """Another visitor's run (a client's here) holds the models: Run says it waits, then runs."""
    from gradio_client import Client
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Generate (live, measured)").click()
    page.locator("#max-new input[type=number]").fill("8")
    page.get_by_label("Measure ar on the same prompt (for the speedup)").uncheck()
    url, _ = server
    story = ("Write a long story about a dragon who learns to cook.", "dyspec", 16, False, 0, 0, 256, False)
    job = Client(url, verbose=False).submit(*story, "h100", 64, 0.1, api_name="/run")
    deadline = time.time() + 120
    while not job.outputs() and time.time() < deadline:  # its first step is out: it holds the models
        time.sleep(0.05)
    page.locator("#run").click()
    expect(page.locator("#stats")).to_contain_text("Waiting in the queue", timeout=30_000)
    assert not job.done()
    expect(page.locator("#stats")).to_contain_text("8 tokens", timeout=180_000)  # its turn came
    # the client's run went to its end first (its job's last state may reach the client a moment later)
    assert "Done (" in job.result(timeout=60)[4]


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium (.ci/run installs it)")
def test_browser_race(page, tmp_path):
    """ar and a policy measured one after the other, replayed side by side, with both ratios labelled."""
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Race against plain decoding").click()
    page.locator("#race-max input[type=number]").fill("48")
    expect(page.locator("#race-policy")).to_contain_text("where nothing matches")  # the default policy, in words
    page.locator("#race-run").click()
    board = page.locator("#race")
    expect(board).to_contain_text("· done", timeout=180_000)  # the replay is under way
    default = defaults_for("cpu")  # the server's device
    expect(board).to_contain_text(f"{default.policy}{options_text(default.options)} at budget")  # as it ran
    expect(board).to_contain_text("measured on this machine", timeout=60_000)
    expect(board).to_contain_text("modelled on H100")
    expect(board).to_contain_text("Same text as plain decoding, token for token")
    lanes = board.locator("div[style*='flex:1']")
    assert lanes.count() == 2 and lanes.nth(0).inner_text().split("\n")[-1] == lanes.nth(1).inner_text().split("\n")[-1]
    first, second = (lanes.nth(i).bounding_box() for i in (0, 1))
    assert abs(first["y"] - second["y"]) < 5  # side by side
    on_a_projector(page, tmp_path, "app-race.png", "#race-run", "#race")
    # other hardware models the finished race at once, without a replay
    page.locator("#race-hardware input").click()
    page.get_by_role("option", name="this machine (measured here)", exact=True).click()
    expect(board).to_contain_text("modelled on this machine", timeout=30_000)
    expect(board).not_to_contain_text("modelled on H100")
    page.locator("#race-again").click()  # replays from the start without measuring again
    expect(board).not_to_contain_text("measured on this machine", timeout=10_000)
    expect(board).to_contain_text("measured on this machine", timeout=60_000)
    expect(page.locator(".error")).to_have_count(0)


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium (.ci/run installs it)")
def test_browser_chinese_text_streams_whole_characters(page):
    """Characters split over tokens stream whole: no replacement character in the text or the tree."""
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Generate (live, measured)").click()
    page.locator("#prompt textarea").fill("请用中文介绍一下北京。")
    page.locator("#max-new input[type=number]").fill("24")
    page.get_by_label("Measure ar on the same prompt (for the speedup)").uncheck()
    page.locator("#run").click()
    expect(page.locator("#stats")).to_contain_text("Done", timeout=120_000)
    text = page.locator("#text").inner_text()
    assert any("\u4e00" <= c <= "\u9fff" for c in text) and "\ufffd" not in text, text
    assert "\ufffd" not in page.locator("#tree").inner_text()
