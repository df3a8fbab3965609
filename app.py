"""dyspec web app: token trees side by side on one answer, and a live run that grows, verifies and
pays off (or not) against autoregressive decoding on this machine.

    python app.py [--host 127.0.0.1] [--port 7860] [--target ID] [--draft ID] [--device D] [--threads N]
                  [--whatif-profile F]

The operator chooses the models when starting the app; a web user picks only among the built-in
policies, within limits (dyspec.views.state.Limits), and never loads a path or remote code.
Generations are queued: at most `--concurrency` run at once (default 1: on a CPU, two at once only
share the cores). What the app shows and how it runs lives in the view model
(dyspec.views.state), shared with the notebook dashboard; this file is layout and bindings.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import inspect
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import gradio as gr
import torch

import dyspec
from dyspec import figures
from dyspec.auto import whatif
from dyspec.errors import DyspecError
from dyspec.eval import speedup
from dyspec.export import VIEW_FORMATS
from dyspec.forward import thread
from dyspec.load import DEFAULT_DRAFT, DEFAULT_TARGET, PRECISIONS, pick_device
from dyspec.views import race, state
from dyspec.views.examples import EXAMPLES

LOOK_FOR = (
    "Every policy below drafts for the same answer, the target's own greedy one, with the same budget. "
    "Look at where each spends its nodes: `chain` on one guess, the static trees (`specinfer`, `sequoia`) in a "
    "shape fixed in advance, `dyspec` where the draft is confident. The table says what each tree bought "
    "(tokens per target forward) and what it cost the draft (draft forwards per step)."
)

# Every event that may run the models (generations, replays, pricing on this machine, which profiles
# them once) waits in one queue: two at once would share the pair's caches and compiled forwards
PAIR = "pair"
QUEUED = (
    "**Waiting in the queue**: another run is on the models (two at once would only share the cores). "
    "Yours starts when it ends."
)
DOWNLOADS = Path(tempfile.mkdtemp(prefix="dyspec-app-"))  # each browser session's last run, as a page


def write_download(page: str, live: state.Live, session: str) -> str:
    """The run's page as a file for the download button, one per browser session (the last run)."""
    folder = hashlib.sha256(session.encode()).hexdigest()[:16]  # the client names its session: never a path
    path = DOWNLOADS / folder / f"dyspec-{live.policy}-run.html"
    path.parent.mkdir(exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return str(path)


GLOSSARY = Path(__file__).with_name("docs") / "concepts" / "glossary.md"  # the docs site's page, read offline


# policy names on one line, and headers that wrap between words, never inside one ("budget"): at a
# projector's 1280 px the table fits the results' column
CSS = "#sbs-table td:first-child { white-space: nowrap; } #sbs-table th { word-break: normal; overflow-wrap: normal; }"


class ModelsInUse:
    """The runs on the pair's models now (generations and races), so that a run asked for while
    `limit` of them go on says that it waits: Gradio's queue shows nothing until its turn."""

    def __init__(self, limit: int):
        self.limit, self.running, self.lock = limit, 0, threading.Lock()

    def said(self, output) -> dict:
        """An event that writes to `output` that the run asked for waits, if it does (never queued itself)."""
        note = lambda: QUEUED if self.running >= self.limit else gr.skip()  # noqa: E731
        return {
            "fn": note,
            "inputs": None,
            "outputs": output,
            "api_name": False,
            "concurrency_limit": None,
            "show_progress": "hidden",
        }

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self.lock:
            self.running += 1
        try:
            yield
        finally:  # a closed browser closes its run's generator too
            with self.lock:
                self.running -= 1


def slider_update(last: int, first: int, value: int | None = None):
    """Move a slider's range to [first, last] (a slider needs first < last) and its value to `value`."""
    return gr.update(maximum=max(last, first + 1), value=last if value is None else value)


def errors_as_toasts(fn):
    """A user's mistake (DyspecError) as a toast, with no traceback in the operator's log."""

    def toast(e: DyspecError) -> gr.Error:
        return gr.Error(str(e), print_exception=False)

    # two wrappers: a function with `yield` in it is a generator, whose returned value Gradio drops
    @functools.wraps(fn)  # Gradio reads the signature through it (a `gr.Request` parameter)
    def streamed(*args):
        try:
            return (yield from fn(*args))
        except DyspecError as e:
            raise toast(e) from None

    @functools.wraps(fn)
    def returned(*args):
        try:
            return fn(*args)
        except DyspecError as e:
            raise toast(e) from None

    return streamed if inspect.isgeneratorfunction(fn) else returned


def pricing_controls(vm: state.ViewModel, label: str, value: str | None, elem_id: str):
    """The hardware menu, and the parametric accelerator's two sliders, shown only when it is chosen."""
    choice = gr.Dropdown(vm.hardware_menu, value=value or vm.hardware_choices[0], label=label, elem_id=elem_id)
    width = gr.Slider(
        1,
        256,
        value=state.WIDTH,
        step=1,
        label="Parametric: tokens a target forward checks at the cost of one",
        info="a GPU checks dozens of tokens in the time of one; a laptop CPU pays for each",
        visible=False,
    )
    fraction = gr.Slider(
        0,
        1,
        value=state.DRAFT_FRACTION,
        step=0.01,
        label="Parametric: a draft forward's cost, as a fraction of the target's",
        visible=False,
    )
    choice.change(lambda c: [gr.update(visible=c == whatif.PARAMETRIC)] * 2, choice, [width, fraction], api_name=False)
    return choice, width, fraction


def examples_menu(prompt: gr.Textbox, expect: gr.Textbox, label: str, elem_id: str) -> None:
    """The examples, each filling the prompt and what to expect of it; a prompt typed over one is no
    example, and what to expect of it goes."""
    gr.Examples(
        [[e.prompt, e.expect] for e in EXAMPLES],
        [prompt, expect],
        example_labels=[e.label for e in EXAMPLES],
        label=label,
        elem_id=elem_id,
    )
    expectations = {e.prompt: e.expect for e in EXAMPLES}
    # on every change, an example's fill included: it sets the expectation it came with again
    prompt.change(lambda text: expectations.get(text, ""), prompt, expect, api_name=False, show_progress="hidden")


def policy_menu(vm: state.ViewModel, policies: list[str], value: str, label: str, elem_id: str) -> gr.Dropdown:
    """A policy menu that says in a line what the chosen policy does."""
    menu = gr.Dropdown(policies, value=value, label=label, info=vm.policy_line(value), elem_id=elem_id)
    menu.change(lambda p: gr.update(info=vm.policy_line(p)), menu, menu, api_name=False)
    return menu


def policy_boxes(vm: state.ViewModel) -> gr.CheckboxGroup:
    """The policies to replay side by side; one too many says so at once, not at Replay."""
    boxes = gr.CheckboxGroup(
        vm.replay_policies,
        value=vm.side_by_side,
        label=f"Policies (up to {state.MAX_SIDE_BY_SIDE})",
        info="ar is the table's baseline row; recycling learns from the target's own outputs, which a replay "
        "does not run",
        elem_id="sbs-policies",
    )
    too_many = errors_as_toasts(lambda chosen: vm.check_policies(chosen, state.MAX_SIDE_BY_SIDE))
    boxes.input(too_many, boxes, None, api_name=False, trigger_mode="always_last")  # the last tick counts
    with gr.Accordion("What each policy does", open=False):
        gr.Markdown(vm.policy_lines(vm.replay_policies), elem_id="sbs-policy-lines")
    return boxes


def replay_budget(vm: state.ViewModel) -> gr.Slider:
    return gr.Slider(
        1,
        vm.limits.replay_budget,
        value=state.SIDE_BY_SIDE_BUDGET,
        step=1,
        label="Budget (drafted tokens per step)",
        info="replayed: even 256-node trees take seconds here",
        elem_id="sbs-budget",
    )


def tree_grid() -> list[gr.Plot]:
    """The side-by-side trees, two a row, so that a projector shows two at once; hidden until drawn."""
    with gr.Row():
        columns = [gr.Column(min_width=300), gr.Column(min_width=300)]
    plots = []
    for i in range(state.MAX_SIDE_BY_SIDE):
        with columns[i % 2]:
            plots.append(gr.Plot(label=f"Tree {i + 1}", elem_id=f"sbs-tree-{i}", visible=False))
    return plots


def answer_trees(vm: state.ViewModel, runs, position: int) -> list:
    """The answer with its token `position` outlined, and each run's tree that drafted it (the plots
    left over hidden)."""
    shown = vm.position_trees(runs, position)
    hidden = [gr.update(visible=False)] * (state.MAX_SIDE_BY_SIDE - len(shown))
    return [vm.position_text(runs, position), *(gr.update(value=f, visible=True) for f in shown), *hidden]


def moved_along_answer(vm: state.ViewModel, runs, position) -> list:
    """A position dragged to or typed, and the views of it; one typed past either end of the answer
    is that end."""
    if not runs:
        return [gr.skip()] * (2 + state.MAX_SIDE_BY_SIDE)
    at = state.answer_position(runs, position)
    return [at, *answer_trees(vm, runs, at)]


def side_by_side_tab(demo: gr.Blocks, vm: state.ViewModel, concurrency: int) -> None:
    """Several policies' trees replayed on one answer, a table of what each bought, and the sweep."""

    @errors_as_toasts
    def check(prompt, policies, budget, max_new_tokens, *_):
        vm.check_policies(policies, state.MAX_SIDE_BY_SIDE)
        vm.check(prompt, int(budget), 0.0, int(max_new_tokens), replay=True)

    @errors_as_toasts
    def replay(prompt, policies, budget, max_new_tokens, hardware, width, draft_fraction):
        runs = vm.replay(prompt, policies, [int(budget)], int(max_new_tokens))
        table = vm.replay_table(runs, vm.replay_models(hardware, width, draft_fraction))
        waiting = vm.sweep_status(prompt, policies, int(max_new_tokens))
        return table, runs, slider_update(runs[0].tokens - 1, 0, 0), *answer_trees(vm, runs, 0), waiting

    @errors_as_toasts
    def sweep(prompt, policies, max_new_tokens):
        return "", vm.sweep(prompt, policies, int(max_new_tokens))[1]

    gr.Markdown(LOOK_FOR)
    with gr.Row():
        with gr.Column(scale=1):
            prompt = gr.Textbox(label="Prompt", value=EXAMPLES[0].prompt, lines=3, elem_id="sbs-prompt")
            button = gr.Button("Replay side by side", variant="primary", elem_id="sbs-run")
            expect = gr.Textbox(label="What to expect", value=EXAMPLES[0].expect, lines=2, interactive=False)
            examples_menu(prompt, expect, "Examples", "sbs-examples")
            policies = policy_boxes(vm)
            budget = replay_budget(vm)
            max_new = gr.Slider(1, vm.limits.max_new_tokens, value=64, step=1, label="Max new tokens")
            pricing = pricing_controls(vm, "Price the trees on", vm.side_by_side_hardware, "sbs-hardware")
        with gr.Column(scale=3):
            table = gr.Markdown(
                "Replaying the opening comparison...", label="Table", show_label=False, elem_id="sbs-table"
            )
            answer = gr.HTML(label="Answer", show_label=False, elem_id="sbs-answer")
            position = gr.Slider(
                0,
                1,
                value=0,
                step=1,
                label="Answer token: drag, or type its position; each tree shown is the one that drafted "
                "the outlined token",
                elem_id="sbs-position",
            )
            tree_plots = tree_grid()
            sweep_status = gr.Markdown(label="Sweep status", show_label=False, elem_id="sbs-sweep-status")
            sweep_plot = gr.Plot(label="Tokens per forward against budget", elem_id="sbs-sweep")
    runs = gr.State(None)
    inputs = [prompt, policies, budget, max_new, *pricing]
    outputs = [table, runs, position, answer, *tree_plots, sweep_status]
    queued = {"concurrency_limit": concurrency, "concurrency_id": PAIR}
    # the table and trees, then the sweep: two endpoints, each returning what it shows; a click while
    # a replay runs is kept for after it (by default Gradio drops it: trigger_mode "once")
    button.click(check, inputs, None, api_name=False, trigger_mode="always_last").success(
        replay, inputs, outputs, api_name="side_by_side", trigger_mode="always_last", **queued
    ).success(sweep, [prompt, policies, max_new], [sweep_status, sweep_plot], api_name="sweep", **queued)
    # the page opens on the opening comparison (replays are kept: after the first, it is instant)
    demo.load(replay, inputs, outputs, api_name=False, **queued).success(
        sweep, [prompt, policies, max_new], [sweep_status, sweep_plot], api_name=False, **queued
    )
    for control in pricing:  # another accelerator reprices the same trees at once
        control.change(
            lambda r, *p: vm.replay_table(r, vm.replay_models(*p)) if r else gr.skip(),
            [runs, *pricing],
            table,
            api_name=False,
            concurrency_id=PAIR,
        )

    # `input`: a drag and a typed position alike (`release` misses typing); the latest one wins; unprocessed,
    # as the slider's own bounds check would paint every output with an error for one typed past the end
    position.input(
        lambda r, pos: moved_along_answer(vm, r, pos),
        [runs, position],
        [position, answer, *tree_plots],
        api_name=False,
        trigger_mode="always_last",
        preprocess=False,
    )


def generate_controls(vm: state.ViewModel) -> list:
    """The live tab's inputs, in the order its handlers take them, then its Run and Stop buttons."""
    prompt = gr.Textbox(label="Prompt", value=EXAMPLES[0].prompt, lines=3, elem_id="prompt")
    with gr.Row():  # under the prompt: at a projector's 720 px the buttons and the stats they fill show together
        run_btn = gr.Button("Run", variant="primary", elem_id="run")
        stop_btn = gr.Button("Stop", elem_id="stop")
    expect = gr.Textbox(label="What to expect", value=EXAMPLES[0].expect, lines=2, interactive=False, elem_id="expect")
    examples_menu(prompt, expect, "Examples: where trees pay, and where they pay little", "examples")
    policy = policy_menu(vm, vm.policies, vm.default_policy, "Policy", "policy")
    with gr.Row():
        budget = gr.Slider(
            1,
            vm.limits.budget,
            value=vm.default_budget,
            step=1,
            label="Budget (drafted tokens per step; acts on a running generation too)",
            scale=3,
            elem_id="budget",
        )
        auto = gr.Checkbox(
            value=False,
            label="auto",
            info="size each tree by its expected gain on this machine",
            elem_id="auto",
            scale=1,
        )
    temperature = gr.Slider(
        0,
        vm.limits.temperature,
        value=0,
        step=0.05,
        label="Temperature (acts on a running generation too)",
        elem_id="temperature",
    )
    seed = gr.Number(value=0, precision=0, label="Seed")
    max_new = gr.Slider(1, vm.limits.max_new_tokens, value=64, step=1, label="Max new tokens", elem_id="max-new")
    measure_ar = gr.Checkbox(value=True, label="Measure ar on the same prompt (for the speedup)")
    return [prompt, policy, budget, auto, temperature, seed, max_new, measure_ar, run_btn, stop_btn]


# the replays' speeds (the race's and a finished live run's) as a Radio's choices: string values,
# since the API documents a Radio's choices as strings and a client sends "0.5"
PACES = [(label, str(speed)) for label, speed in race.PACES]
LIVE_OUTPUTS = 10  # what live_views returns: text, tree, chart, depth, stats, run, two sliders, what-if, download
LOADED_SETTINGS = 6  # the controls a loaded run sets beside its prompt (`ViewModel.loaded_settings`)


def live_views(vm: state.ViewModel, live: state.Live, draw: bool, pricing: tuple, session: str) -> tuple:
    """Everything the tab shows of a run: a finished one opens on its featured step, with its
    what-if and its download ready."""
    shown = state.shown_step(live)
    done = live.finished is not None and bool(live.steps)
    return (
        vm.text(live.steps, shown if done else None),
        figures.tree_figure(live.steps[shown]) if draw else gr.skip(),
        vm.steps_chart(live) if draw else gr.skip(),
        vm.depth_chart(live.steps) if draw else gr.skip(),
        vm.stats(live),
        live,
        slider_update(len(live.steps) - 1, 0, shown),
        slider_update(len(live.steps[shown].tokens), 1) if live.steps else gr.skip(),
        vm.whatif(live, *pricing) if done else gr.skip(),
        gr.update(value=write_download(vm.download(live, *pricing), live, session), interactive=True)
        if done
        else gr.skip(),
    )


def live_handlers(vm: state.ViewModel, in_use: ModelsInUse) -> tuple:
    """The live tab's handlers: check a request, run it (streaming its views), stop it, tune it
    while it runs, show a step."""

    @errors_as_toasts
    def check(prompt, policy, budget, auto, temperature, seed, max_new_tokens, *_):
        vm.check(prompt, state.budget_of(budget, auto), temperature, int(max_new_tokens))
        vm.check_policies([policy])

    stops: dict[str, threading.Event] = {}  # per browser session: Stop ends its run after the step
    tunings: dict[str, state.Knobs] = {}  # per browser session: its running generation's budget and temperature

    @errors_as_toasts
    def run(
        prompt,
        policy,
        budget,
        auto,
        temperature,
        seed,
        max_new_tokens,
        measure_ar,
        hardware,
        width,
        draft_fraction,
        request: gr.Request,
    ):
        stop = stops[request.session_hash] = threading.Event()
        knobs = tunings[request.session_hash] = vm.knobs(state.budget_of(budget, auto), temperature)
        settings = (temperature, int(seed), int(max_new_tokens), None, measure_ar, stop.is_set, knobs)
        with in_use.held():
            for live, draw in state.paced(vm.run(prompt, policy, knobs.budget, *settings)):
                yield live_views(vm, live, draw, (hardware, width, draft_fraction), request.session_hash)

    @errors_as_toasts
    def check_file(run_file: bytes, *_) -> None:
        """A file that is not a downloaded run, said before `load` runs: an error there would mark
        every output, and what is on screen stays."""
        vm.load(run_file)

    @errors_as_toasts
    def load(run_file: bytes, hardware, width, draft_fraction, request: gr.Request):
        """A downloaded run, shown as it was when it finished, and the controls it ran with."""
        live = vm.load(run_file)
        settings = (gr.skip() if value is None else value for value in vm.loaded_settings(live))
        pricing = (hardware, width, draft_fraction)
        return *live_views(vm, live, True, pricing, request.session_hash), live.prompt, *settings

    def stop(request: gr.Request) -> None:
        stops.get(request.session_hash, threading.Event()).set()  # a session that ran nothing: no-op

    @errors_as_toasts
    def tune(policy, budget, auto, temperature, request: gr.Request) -> None:
        """The budget, auto and temperature act from the running generation's next step."""
        if request.session_hash in tunings:
            vm.tune(tunings[request.session_hash], policy, state.budget_of(budget, auto), temperature)

    def show_step(live, index, growth=None, so_far=False):
        """The tree of step `index` grown to `growth` nodes (all of them by default), the text with that
        step's tokens outlined (`so_far`: the text up to that step alone), and the Step slider on it."""
        if not live or not live.steps:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        index = max(0, min(int(index), len(live.steps) - 1))
        step = live.steps[index]
        upto = len(step.tokens) if growth is None else min(int(growth), len(step.tokens))
        text = vm.text(live.steps[: index + 1] if so_far else live.steps, index)
        steps = slider_update(len(live.steps) - 1, 0, index)
        return figures.tree_figure(step, upto), slider_update(len(step.tokens), 1, upto), text, steps

    def replay(live, pace):
        """The finished run again, a step at a time on its measured clock slowed to `pace`, never faster
        than a browser draws a tree: the text so far, the step's tree and the Step slider together.
        A step waits its time before it shows, and none follows the last: Gradio writes the last frame
        again when a handler ends, which after a wait would land over a step typed meanwhile."""
        for index, step in enumerate(live.steps if live and live.finished is not None else ()):
            time.sleep(max(speedup.step_seconds(step) / float(pace), race.FRAME_S) if index else 0)
            yield show_step(live, index, so_far=True)

    return check, run, stop, tune, show_step, replay, check_file, load


def export_panel(vm: state.ViewModel, live_state: gr.State) -> None:
    """The run's tree shape in a serving engine's format, each format saying where it goes."""
    with gr.Accordion("Export this run's tree to a serving engine", open=False):
        with gr.Row():
            fmt = gr.Dropdown(
                list(VIEW_FORMATS), value="trtllm", label="Format", info=VIEW_FORMATS["trtllm"], elem_id="format"
            )
            fmt.change(lambda f: gr.update(info=VIEW_FORMATS[f]), fmt, fmt, api_name=False)
            export_btn = gr.Button("Export this tree", elem_id="export")
        export_code = gr.Code(language="python", label="Paste into your engine's config", elem_id="snippet")
    export_btn.click(
        lambda live, engine_format: vm.export(live or state.Live(), engine_format),
        [live_state, fmt],
        export_code,
        api_name="export",
    )


def whatif_panel(vm: state.ViewModel) -> tuple[tuple, gr.Markdown]:
    """A finished run's trees priced on other hardware: the menu's controls and the verdict."""
    with gr.Accordion("Hardware what-if: this run's trees priced elsewhere", open=True):
        gr.Markdown(
            "Tokens per forward belong to the model pair and the text; the speedup is that times "
            "the hardware's price of a tree. Priced with a latency profile (forwards only)."
        )
        with gr.Row():
            pricing = pricing_controls(vm, "Hardware", None, "hardware")
        verdict = gr.Markdown(
            "Run a generation to price its trees.", label="What-if", show_label=False, elem_id="whatif"
        )
    return pricing, verdict


def generate_tab(vm: state.ViewModel, in_use: ModelsInUse) -> None:
    """A live run measured against `ar`: its text, trees, per-step chart, export and what-if."""
    check, run, stop, tune, show_step, replay, check_file, load = live_handlers(vm, in_use)
    live_state = gr.State(None)
    gr.Markdown(
        f"A live run on this machine, measured against plain decoding (`ar`) on the same prompt. "
        f"The default, `{vm.default_text}`, is the fastest measured on a {vm.pair.device.type}; on a CPU "
        "every extra node costs, so bigger trees are usually slower here (the side-by-side tab shows them). "
        "In the text, green tokens were drafted and accepted, blue ones are the target's own."
    )
    with gr.Row():
        with gr.Column(scale=1):
            *settings, run_btn, stop_btn = generate_controls(vm)
        with gr.Column(scale=2):
            stats = gr.Markdown(label="Stats", show_label=False, elem_id="stats")
            text = gr.HTML(label="Text", show_label=False, elem_id="text")
            tree = gr.Plot(label="Token tree", elem_id="tree")
            step_slider = gr.Slider(0, 1, value=0, step=1, label="Step", elem_id="step")
            with gr.Row():
                pace = gr.Radio(PACES, value=PACES[2][1], label="Replay pace", elem_id="live-pace", scale=3)
                replay_btn = gr.Button("Replay this run", elem_id="live-replay", scale=1)
                next_btn = gr.Button("Next step", elem_id="live-next", scale=1)
            growth_slider = gr.Slider(
                1, 2, value=1, step=1, label="Nodes shown: the root and the drafted ones, in growth order"
            )
            with gr.Row():
                download = gr.DownloadButton(
                    "Download this run (one HTML file)", interactive=False, elem_id="download", scale=2
                )
                upload = gr.UploadButton(
                    "Load a downloaded run", file_types=[".html", ".json"], type="binary", elem_id="upload", scale=2
                )
            export_panel(vm, live_state)
            with gr.Row():
                chart = gr.Plot(label="Per step", elem_id="chart")
                depth = gr.Plot(label="Acceptance by tree depth", elem_id="depth")
            pricing, whatif_md = whatif_panel(vm)
    inputs = [*settings, *pricing]
    outputs = [text, tree, chart, depth, stats, live_state, step_slider, growth_slider, whatif_md, download]
    # checked first (a mistake is a toast, with no badge on the outputs), then the queue said, then run
    run_btn.click(check, inputs, None, api_name=False).success(**in_use.said(stats)).success(
        run, inputs, outputs, api_name="run", concurrency_limit=in_use.limit, concurrency_id=PAIR
    )
    # Stop asks the run to end cleanly after its step (no concurrency limit: never behind the run); the
    # run's last state stays on screen, where cancelling the event would replace it with errors
    stop_btn.click(stop, None, None, concurrency_limit=None, api_name=False)
    # the knobs act on a running generation from its next step (never queued behind the run)
    policy, budget, auto, temperature = settings[1:5]
    auto.change(lambda a: gr.update(interactive=not a), auto, budget, api_name=False)  # auto sizes the trees
    for control in (budget, auto, temperature):
        control.change(tune, [policy, budget, auto, temperature], None, concurrency_limit=None, api_name=False)
    shown = [tree, growth_slider, text, step_slider]
    for slider in (step_slider, growth_slider):  # dragged or typed (`input`), the latest one wins
        slider.input(
            show_step, [live_state, step_slider, growth_slider], shown, api_name=False, trigger_mode="always_last"
        )
    next_step = lambda live, index: show_step(live, int(index) + 1)  # noqa: E731
    next_btn.click(next_step, [live_state, step_slider], shown, api_name=False)
    replay_btn.click(replay, [live_state, pace], shown, api_name=False, trigger_mode="always_last")
    # its prompt and the controls it ran with; in the model's queue: pricing on this machine may profile it
    upload.upload(check_file, upload, None, api_name=False).success(
        load, [upload, *pricing], [*outputs, *settings[:7]], api_name="load_run", concurrency_id=PAIR
    )
    for control in pricing:
        control.change(
            lambda live, *p: vm.whatif(live or state.Live(), *p),
            [live_state, *pricing],
            whatif_md,
            api_name=False,
            concurrency_id=PAIR,
        )


def race_controls(vm: state.ViewModel) -> tuple[list, gr.Button, gr.Button]:
    """The race's inputs, in the order its handlers take them (prompt, policy, budget, length, pace),
    and its Race and Replay buttons, under the prompt."""
    prompt = gr.Textbox(label="Prompt", value=EXAMPLES[1].prompt, lines=3, elem_id="race-prompt")
    with gr.Row():
        start = gr.Button("Race", variant="primary", elem_id="race-run")
        again = gr.Button("Replay the race", elem_id="race-again")
    expect = gr.Textbox(label="What to expect", value=EXAMPLES[1].expect, lines=2, interactive=False)
    examples_menu(prompt, expect, "Examples", "race-examples")
    policy = policy_menu(vm, vm.racers, vm.first_racer, "Policy against ar", "race-policy")
    budget = gr.Slider(1, vm.limits.budget, value=vm.default_budget, step=1, label="Budget", elem_id="race-budget")
    max_new = gr.Slider(1, vm.limits.max_new_tokens, value=96, step=1, label="Max new tokens", elem_id="race-max")
    pace = gr.Radio(PACES, value=PACES[0][1], label="Replay pace", elem_id="race-pace")
    return [prompt, policy, budget, max_new, pace], start, again


def race_tab(vm: state.ViewModel, in_use: ModelsInUse) -> None:
    """Plain decoding and a policy measured one after the other, then replayed side by side on
    their measured clocks, with the measured ratio and a modelled one."""

    @errors_as_toasts
    def check(prompt, policy, budget, max_new_tokens, *_):
        vm.check(prompt, int(budget), 0.0, int(max_new_tokens))
        vm.check_policies([policy])

    def replay(run, pace, hardware, width, draft_fraction):
        if run is None:
            return
        model = vm.latency_model(hardware, width, draft_fraction)
        for index, t in enumerate(race.frame_times(run, float(pace))):
            if index:  # none after the last frame (as the live replay)
                time.sleep(race.FRAME_S)
            yield race.race_frame(vm, run, t, model)

    @errors_as_toasts
    def run(prompt, policy, budget, max_new_tokens, pace, hardware, width, draft_fraction):
        with in_use.held():
            for now in race.run_race(vm, prompt, policy, int(budget), int(max_new_tokens)):
                yield race.progress_text(now), now
        for frame in replay(now, pace, hardware, width, draft_fraction):
            yield frame, now

    gr.Markdown(
        "Plain decoding (`ar`) against a policy on the same prompt. Each is measured on its own, one after the "
        "other, so that they never share the cores; then both are replayed side by side on the clocks they "
        "measured. Both decode greedily (temperature 0): the texts are the same, only their pace differs."
    )
    with gr.Row():
        with gr.Column(scale=1):
            controls, start, again = race_controls(vm)
            pricing = pricing_controls(vm, "Model the same trees on", vm.side_by_side_hardware, "race-hardware")
        with gr.Column(scale=3):
            board = gr.HTML(
                "Press Race: ar runs, then the policy, then both replay side by side.",
                label="Race",
                show_label=False,
                elem_id="race",
            )
    raced = gr.State(None)
    inputs = [*controls, *pricing]
    start.click(check, inputs, None, api_name=False).success(**in_use.said(board)).success(
        run, inputs, [board, raced], api_name="race", concurrency_limit=in_use.limit, concurrency_id=PAIR
    )
    again.click(replay, [raced, controls[-1], *pricing], board, api_name=False, concurrency_id=PAIR)

    def reprice(run, hardware, width, draft_fraction):
        """The finished race modelled on other hardware at once, without replaying it."""
        if run is None:
            return gr.skip()
        return race.race_frame(vm, run, run.seconds, vm.latency_model(hardware, width, draft_fraction))

    for control in pricing:
        control.change(reprice, [raced, *pricing], board, api_name=False, concurrency_id=PAIR)


def device_text(pair: dyspec.ModelPair) -> str:
    """The pair's device, and on a CPU the threads its forwards run on."""
    if pair.device.type != "cpu":
        return str(pair.device)
    n = thread.threads()
    return f"cpu, {n} thread{'s' * (n > 1)} of {os.cpu_count()} cores"


def build_app(pair: dyspec.ModelPair, concurrency: int = 1, profiles: dict | None = None) -> gr.Blocks:
    """`profiles`: latency models the operator loaded for the what-if menu, besides the shipped
    ones, this machine's and a parametric accelerator."""
    vm = state.ViewModel(pair, profiles)
    in_use = ModelsInUse(concurrency)
    vm.warm_up()
    vm.replay(EXAMPLES[0].prompt, vm.side_by_side, [state.SIDE_BY_SIDE_BUDGET])  # the page opens on it
    with gr.Blocks(title="dyspec") as demo:
        gr.Markdown(
            f"# dyspec: speculative decoding with token trees\nTarget `{pair.target_name}` ({pair.precision}), "
            f"draft `{pair.drafts_label}`, {device_text(pair)}. A small draft model proposes a tree of next tokens; "
            "the target checks the whole tree in one forward and keeps the longest path it agrees with, plus one token "
            "of its own, so the answer is exactly the target's."
        )
        if GLOSSARY.is_file():
            with gr.Accordion("Glossary: the words this page uses", open=False, elem_id="glossary"):
                gr.Markdown(GLOSSARY.read_text(encoding="utf-8").split("\n", 1)[1])  # below its title
        with gr.Tab("Trees side by side"):
            side_by_side_tab(demo, vm, concurrency)
        with gr.Tab("Generate (live, measured)"):
            generate_tab(vm, in_use)
        with gr.Tab("Race against plain decoding"):
            race_tab(vm, in_use)
    demo.queue(default_concurrency_limit=concurrency, max_size=64)
    return demo


def model_threads(device: torch.device, asked: int | None) -> int | None:
    """The intra-op threads for the models: as asked, else on a CPU one fewer than torch would use
    (the browser that shows the page draws on the same cores, and a forward split over all of them
    waits for the one the browser took: docs/results/cpu-app-threads.md); None leaves torch's."""
    if asked is not None:
        if asked < 1:
            raise DyspecError(f"--threads must be at least 1, got {asked}")
        return asked
    return max(1, thread.threads() - 1) if device.type == "cpu" else None


def main() -> None:
    parser = argparse.ArgumentParser(description="dyspec web app")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--device", default=None)
    parser.add_argument("--precision", default="auto", choices=PRECISIONS)
    parser.add_argument("--concurrency", type=int, default=1, help="generations at once; others wait in the queue")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads for the models (default on a CPU: one fewer than the cores torch uses, "
        "leaving one to the browser)",
    )
    parser.add_argument(
        "--whatif-profile",
        action="append",
        default=[],
        metavar="FILE",
        help="a latency profile from `dyspec profile --json` on other hardware, for the what-if menu (repeatable)",
    )
    args = parser.parse_args()
    try:
        profiles = {m.name: m for m in map(whatif.load_profile, args.whatif_profile)}
        if (threads := model_threads(pick_device(args.device), args.threads)) is not None:
            thread.set_threads(threads)
        pair = dyspec.load_pair(args.target, args.draft, args.device, precision=args.precision)
        print("warming up (one short generation per default policy)...", flush=True)
        demo = build_app(pair, args.concurrency, profiles)
    except DyspecError as e:
        parser.exit(2, f"app.py: error: {e}\n")
    demo.launch(server_name=args.host, server_port=args.port, show_error=True, css=CSS)


if __name__ == "__main__":
    main()
