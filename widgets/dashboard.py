"""Notebook front ends over the same view model as the web app (dyspec.views.state):
`SideBySide` replays several policies on one answer and draws their trees next to each other;
`Dashboard` runs one policy live and measures it against autoregressive decoding. The figures come
from `dyspec.figures` and are kept as plotly figures (`tree_fig`, `trees`, `sweep_fig`, ...)
so they can be inspected from Python and in tests.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import ipywidgets as W
import plotly.graph_objects as go
from IPython.display import display

import dyspec
from dyspec import figures
from dyspec.auto import whatif
from dyspec.core.events import GenerationFinished
from dyspec.decode.replay import ReplayRun
from dyspec.export import VIEW_FORMATS
from dyspec.policies import policy_options
from dyspec.views import race
from dyspec.views.examples import EXAMPLES
from dyspec.views.state import (
    DRAFT_FRACTION,
    MAX_SIDE_BY_SIDE,
    SIDE_BY_SIDE_BUDGET,
    WIDTH,
    Live,
    ViewModel,
    budget_of,
    paced,
    shown_step,
)

# While a generation runs, the figures redraw at most every REDRAW_S (dyspec.views.state.paced). On 2 cores
# even that costs most of the speedup (docs/guide/app.md), so there the figures wait for the end
# unless the user asks for them live.
LIVE_FIGURES = (os.cpu_count() or 1) > 2


def _draw(out: W.Output, fig: go.Figure) -> None:
    """Show `fig` in `out`, replacing what it showed, from any thread: an Output widget captures
    `fig.show()` only in the kernel's own thread, and the buttons' runs draw from theirs."""
    bundle = fig._repr_mimebundle_()  # as the notebook's plotly renderer makes it, not displayed here
    out.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)


class Pricing:
    """The hardware menu, with the parametric accelerator's sliders shown only when it is chosen."""

    def __init__(self, vm: ViewModel, value: str | None = None, description: str = "What-if"):
        self.vm = vm
        self.choice = W.Dropdown(
            options=vm.hardware_menu, value=value or vm.hardware_choices[0], description=description
        )
        self.width = W.IntSlider(
            WIDTH, min=1, max=256, description="Flat width", tooltip="tokens a target forward checks at the cost of one"
        )
        self.draft_fraction = W.FloatSlider(
            DRAFT_FRACTION,
            min=0,
            max=1,
            step=0.01,
            description="Draft cost",
            tooltip="a draft forward's cost, as a fraction of the target's",
        )
        self.choice.observe(lambda _: self._show(), names="value")
        self._show()

    def _show(self) -> None:
        for slider in (self.width, self.draft_fraction):
            slider.layout.display = None if self.choice.value == whatif.PARAMETRIC else "none"

    def values(self) -> tuple[str, int, float]:
        """The choice and the parametric accelerator's settings, as the view model takes them."""
        return self.choice.value, self.width.value, self.draft_fraction.value

    def observe(self, fn) -> None:
        for control in (self.choice, self.width, self.draft_fraction):
            control.observe(lambda _: fn(), names="value")

    def widget(self) -> W.Widget:
        return W.HBox([self.choice, self.width, self.draft_fraction])


def _examples(prompt: W.Textarea, own: str | None, first: int = 0) -> tuple[W.Dropdown, W.HTML]:
    """The example menu, filling `prompt` (with example `first` unless `own`) and a line on what to expect."""
    menu = W.Dropdown(
        options=[("(your own prompt)", None), *((e.label, e) for e in EXAMPLES)],
        value=None if own else EXAMPLES[first],
        description="Example",
    )
    expect = W.HTML()

    def pick(_=None) -> None:
        if menu.value is not None:
            prompt.value = menu.value.prompt
        expect.value = f"<i>{menu.value.expect}</i>" if menu.value is not None else ""

    menu.observe(pick, names="value")
    pick()
    return menu, expect


class Dashboard:
    """Type a prompt, pick a policy and budget (or auto), run, and watch the token tree grow, get
    verified, and pay off against autoregressive decoding. `profiles`: latency models
    (`dyspec.auto.whatif.load_profile`) for the what-if menu; `vm`: a view model to share (its
    caches keep `ar`'s measured steps per prompt and settings)."""

    def __init__(
        self,
        pair: dyspec.ModelPair,
        prompt: str | None = None,
        profiles: dict | None = None,
        vm: ViewModel | None = None,
    ):
        self.vm = vm or ViewModel(pair, profiles)
        self.live = Live()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._knobs = None  # the running generation's budget and temperature (`tune`)
        limits = self.vm.limits
        self.prompt = W.Textarea(prompt or "", description="Prompt", layout=W.Layout(width="100%", height="90px"))
        self.example, self.expect = _examples(self.prompt, prompt)
        self.policy = W.Dropdown(options=self.vm.policies, value=self.vm.default_policy, description="Policy")
        self.policy_help = W.HTML()  # what the chosen policy does, in one line
        self.budget = W.IntSlider(self.vm.default_budget, min=1, max=limits.budget, description="Budget")
        self.auto = W.Checkbox(False, description="auto budget", tooltip="size each tree by its expected gain here")
        self.temperature = W.FloatSlider(0.0, min=0, max=limits.temperature, step=0.05, description="Temperature")
        self.option_controls = {
            "threshold": W.FloatText(0.0, description="Threshold", tooltip="dyspec-threshold's t (0: 1/budget)"),
            "h": W.FloatSlider(0.5, min=0.05, max=0.95, step=0.05, description="h", tooltip="specdecpp's stop level"),
            "max_depth": W.IntSlider(16, min=1, max=32, description="Max depth"),
        }
        self.seed = W.IntText(0, description="Seed")
        self.max_new_tokens = W.IntSlider(64, min=1, max=limits.max_new_tokens, description="Max tokens")
        self.measure_ar = W.Checkbox(True, description="measure ar (for the speedup)")
        self.live_figures = W.Checkbox(LIVE_FIGURES, description="redraw figures while running")
        self.run_button = W.Button(description="Run", button_style="primary")
        self.stop_button = W.Button(description="Stop")
        self.step_slider = W.IntSlider(0, min=0, max=0, description="Step")
        self.growth_slider = W.IntSlider(1, min=1, max=1, description="Nodes shown")
        # Replays the tree's growth: Play ticks its value in the browser, the link moves the slider.
        self.growth_play = W.Play(1, min=1, max=1, interval=400, description="Replay growth")
        W.link((self.growth_play, "value"), (self.growth_slider, "value"))
        W.link((self.growth_play, "max"), (self.growth_slider, "max"))
        self.pricing = Pricing(self.vm)
        self.whatif = W.HTML("Run a generation to price its trees.")
        self.export_format = W.Dropdown(options=list(VIEW_FORMATS), value="trtllm", description="Export")
        self.export_help = W.HTML()  # where the chosen format's snippet goes
        self.export_format.observe(lambda _: self._show_options(), names="value")
        self.export_button = W.Button(description="Export this tree")
        self.export_text = W.Textarea(layout=W.Layout(width="100%"), rows=3)
        self.error = W.HTML()
        self.stats = W.HTML()
        self.text = W.HTML()
        self.tree_fig = go.Figure()
        self.steps_fig = go.Figure()
        self.calibration_fig = go.Figure()
        self.depth_fig = go.Figure()
        self._tree_out, self._steps_out, self._calibration_out = W.Output(), W.Output(), W.Output()
        self._depth_out = W.Output()
        self.run_button.on_click(lambda _: self.start())
        self.export_button.on_click(lambda _: self.export())
        self.stop_button.on_click(lambda _: self.stop())
        self.step_slider.observe(lambda _: self.show_step(), names="value")
        self.growth_slider.observe(lambda _: self.show_step(), names="value")
        self.policy.observe(lambda _: self._show_options(), names="value")
        self.pricing.observe(self.price)
        for control in (self.budget, self.auto, self.temperature):
            control.observe(lambda _: self.tune(), names="value")
        self.auto.observe(lambda change: setattr(self.budget, "disabled", change["new"]), names="value")
        self._show_options()

    @property
    def steps(self):
        return self.live.steps

    @property
    def finished(self) -> GenerationFinished | None:
        return self.live.finished

    def _show_options(self) -> None:
        self.policy_help.value = f"<i>{self.vm.policy_line(self.policy.value)}</i>"
        self.export_help.value = f"<i>{VIEW_FORMATS[self.export_format.value]}</i>"
        takes = policy_options(self.policy.value)
        for name, control in self.option_controls.items():
            control.layout.display = None if name in takes else "none"

    def options(self) -> dict:
        """Policy options set by the controls (only those the chosen policy takes)."""
        takes = policy_options(self.policy.value)
        chosen = {name: c.value for name, c in self.option_controls.items() if name in takes}
        if not chosen.get("threshold", 1):
            del chosen["threshold"]  # 0: the policy's own default
        return chosen

    def price(self) -> str:
        """The what-if lines for the last run under the chosen hardware (also shown)."""
        self.whatif.value = self.vm.whatif(self.live, *self.pricing.values())
        return self.whatif.value

    def export(self) -> str:
        """The last run's tree shape in the chosen serving engine's format (also shown)."""
        self.export_text.value = self.vm.export(self.live, self.export_format.value)
        return self.export_text.value

    def download(self, path: str | Path) -> Path:
        """Write the last run as one HTML page to share (`dyspec.views.share`): it opens offline in
        any browser, and `load` or the web app's "Load a downloaded run" reads it back."""
        path = Path(path)
        path.write_text(self.vm.download(self.live, *self.pricing.values()), encoding="utf-8")
        return path

    def load(self, path: str | Path) -> None:
        """Show a run that `download` (or the web app) wrote, as it was when it finished."""
        self.live = self.vm.load(Path(path).read_bytes())
        self.prompt.value = self.live.prompt
        self._refresh()
        self.price()

    def run(self) -> GenerationFinished | None:
        """Generate with the current settings, updating the views as it goes (blocking). A
        mistake in the settings is shown, and the last run's results stay."""
        self._stop.clear()
        budget = budget_of(self.budget.value, self.auto.value)
        self._knobs = knobs = self.vm.knobs(budget, self.temperature.value)
        settings = (self.temperature.value, self.seed.value, self.max_new_tokens.value, self.options())
        runs = self.vm.run(
            self.prompt.value, self.policy.value, budget, *settings, self.measure_ar.value, self._stop.is_set, knobs
        )
        try:
            for live, draw in paced(runs):
                self.live, self.error.value = live, ""
                # the last state's figures are drawn once, by the refresh after the run
                self._refresh(figures_too=draw and self.live_figures.value and live.finished is None)
        except dyspec.DyspecError as e:
            self.error.value = f"<span style='color:#D55E00'>{e}</span>"
            return None
        finally:
            self._knobs = None
        self._refresh()
        self.price()
        return self.finished

    def start(self) -> None:
        """Run in a background thread, so the notebook stays responsive and Stop works."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self.run, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the running generation cleanly after the current step."""
        self._stop.set()

    def tune(self) -> None:
        """The budget, auto and temperature act on a running generation from its next step."""
        if self._knobs is None:
            return
        budget = budget_of(self.budget.value, self.auto.value)
        try:
            self.vm.tune(self._knobs, self.policy.value, budget, self.temperature.value, self.options())
        except dyspec.DyspecError as e:
            self.error.value = f"<span style='color:#D55E00'>{e}</span>"

    def show_step(self) -> None:
        if not self.steps:
            return
        step = self.steps[min(self.step_slider.value, len(self.steps) - 1)]
        self.growth_slider.max = len(step.tokens)
        self.tree_fig = figures.tree_figure(step, self.growth_slider.value)
        self.text.value = self.vm.text(self.steps, self.steps.index(step))  # the step's tokens outlined
        _draw(self._tree_out, self.tree_fig)

    def _refresh(self, figures_too: bool = True) -> None:
        self.text.value = self.vm.text(self.steps)
        self.stats.value = self.vm.stats(self.live)
        if not figures_too or not self.steps:
            return
        self.steps_fig = self.vm.steps_chart(self.live)
        self.calibration_fig = figures.calibration_figure(*figures.calibration_counts(self.steps))
        self.depth_fig = self.vm.depth_chart(self.steps)
        shown = shown_step(self.live)
        last = self.steps[shown]
        with self.step_slider.hold_trait_notifications(), self.growth_slider.hold_trait_notifications():
            self.step_slider.max = len(self.steps) - 1
            self.step_slider.value = shown
            self.growth_slider.max = len(last.tokens)
            self.growth_slider.value = len(last.tokens)
        if self.finished is not None:
            self.text.value = self.vm.text(self.steps, shown)
        self.tree_fig = figures.tree_figure(last)
        _draw(self._tree_out, self.tree_fig)
        _draw(self._steps_out, self.steps_fig)
        _draw(self._calibration_out, self.calibration_fig)
        _draw(self._depth_out, self.depth_fig)

    def widget(self) -> W.Widget:
        controls = W.VBox(
            [
                W.HBox([self.example, self.expect]),
                self.prompt,
                W.HBox([self.policy, self.budget, self.auto]),
                self.policy_help,
                W.HBox([self.temperature, *self.option_controls.values()]),
                W.HBox([self.seed]),
                W.HBox([self.max_new_tokens, self.measure_ar, self.live_figures]),
                W.HBox([self.run_button, self.stop_button]),
                self.error,
            ]
        )
        return W.VBox(
            [
                controls,
                self.stats,
                self.text,
                W.HBox([self.step_slider, self.growth_play, self.growth_slider]),
                self._tree_out,
                W.HBox([self._steps_out, self._calibration_out]),
                self._depth_out,
                self.pricing.widget(),
                self.whatif,
                W.HBox([self.export_format, self.export_button]),
                self.export_help,
                self.export_text,
            ]
        )

    def _ipython_display_(self) -> None:
        display(self.widget())


class SideBySide:
    """Several policies' trees on the same answer at one budget (replayed at T = 0: exact trees,
    modelled times), a table of tokens per forward and modelled speedups, and tokens per forward
    against budget for each policy."""

    def __init__(self, pair: dyspec.ModelPair, policies=None, budget: int = SIDE_BY_SIDE_BUDGET, vm=None):
        self.vm = vm or ViewModel(pair)
        self.runs: list[ReplayRun] = []
        self.sweep: list[ReplayRun] = []
        self.prompt = W.Textarea(description="Prompt", layout=W.Layout(width="100%", height="90px"))
        self.example, self.expect = _examples(self.prompt, None)
        self.policies = W.SelectMultiple(
            options=self.vm.replay_policies, value=tuple(policies or self.vm.side_by_side), description="Policies"
        )
        self.budget = W.IntSlider(budget, min=1, max=self.vm.limits.replay_budget, description="Budget")
        self.max_new_tokens = W.IntSlider(64, min=1, max=self.vm.limits.max_new_tokens, description="Max tokens")
        self.pricing = Pricing(self.vm, self.vm.side_by_side_hardware, "Price on")
        self.run_button = W.Button(description="Replay side by side", button_style="primary")
        self.position = W.IntSlider(0, min=0, max=0, description="Answer token")
        self.answer = W.HTML()  # the replayed answer, the token at `position` outlined
        self.error = W.HTML()
        self.table = W.HTML()
        self.trees: list[go.Figure] = []
        self.sweep_fig = go.Figure()
        self._tree_outs = [W.Output() for _ in range(MAX_SIDE_BY_SIDE)]
        self._sweep_out = W.Output()
        self.run_button.on_click(lambda _: self.run())
        self.position.observe(lambda _: self.show_position(), names="value")
        self.pricing.observe(self._table)

    def run(self, sweep: bool = True) -> list[ReplayRun]:
        """Replay the chosen policies at the budget (then, with `sweep`, at every budget of
        SWEEP_BUDGETS up to SWEEP_MAX for the chart)."""
        policies, prompt, max_new = list(self.policies.value), self.prompt.value, self.max_new_tokens.value
        try:
            self.runs = self.vm.replay(prompt, policies, [self.budget.value], max_new)
        except dyspec.DyspecError as e:
            self.error.value = f"<span style='color:#D55E00'>{e}</span>"
            return self.runs
        self.error.value = ""
        self._table()
        with self.position.hold_trait_notifications():
            self.position.max, self.position.value = self.runs[0].tokens - 1, 0
        self.show_position()
        if sweep:
            self.sweep, self.sweep_fig = self.vm.sweep(prompt, policies, max_new)
            _draw(self._sweep_out, self.sweep_fig)
        return self.runs

    def _table(self) -> None:
        if self.runs:
            table = self.vm.replay_table(self.runs, self.vm.replay_models(*self.pricing.values()))
            self.table.value = f"<pre>{table}</pre>"

    def show_position(self) -> None:
        self.trees = self.vm.position_trees(self.runs, self.position.value)
        self.answer.value = self.vm.position_text(self.runs, self.position.value)
        for out, fig in zip(self._tree_outs, self.trees):
            _draw(out, fig)
        for out in self._tree_outs[len(self.trees) :]:
            out.outputs = ()

    def widget(self) -> W.Widget:
        return W.VBox(
            [
                W.HBox([self.example, self.expect]),
                self.prompt,
                W.HBox([self.policies, W.VBox([self.budget, self.max_new_tokens])]),
                self.pricing.widget(),
                self.run_button,
                self.error,
                self.table,
                self.answer,
                self.position,
                W.GridBox(self._tree_outs, layout=W.Layout(grid_template_columns="1fr 1fr")),
                self._sweep_out,
            ]
        )

    def _ipython_display_(self) -> None:
        display(self.widget())


class Race:
    """Plain decoding (`ar`) against a policy on one prompt, measured one after the other so that
    they never share the cores, then replayed side by side on their measured clocks with the
    measured ratio and one modelled on the chosen hardware (`dyspec.views.race`)."""

    def __init__(self, pair: dyspec.ModelPair, prompt: str | None = None, vm: ViewModel | None = None):
        self.vm = vm or ViewModel(pair)
        self.raced: race.Race | None = None  # the last race measured
        self.prompt = W.Textarea(prompt or "", description="Prompt", layout=W.Layout(width="100%", height="90px"))
        self.example, self.expect = _examples(self.prompt, prompt, first=1)
        self.policy = W.Dropdown(options=self.vm.racers, value=self.vm.first_racer, description="Policy")
        self.budget = W.IntSlider(self.vm.default_budget, min=1, max=self.vm.limits.budget, description="Budget")
        self.max_new_tokens = W.IntSlider(96, min=1, max=self.vm.limits.max_new_tokens, description="Max tokens")
        self.pace = W.Dropdown(options=race.PACES, description="Pace")
        self.pricing = Pricing(self.vm, self.vm.side_by_side_hardware, "Model on")
        self.run_button = W.Button(description="Race", button_style="primary")
        self.replay_button = W.Button(description="Replay the race")
        self.board, self.error = W.HTML(), W.HTML()
        self.run_button.on_click(lambda _: threading.Thread(target=self.run, daemon=True).start())
        self.replay_button.on_click(lambda _: threading.Thread(target=self.replay, daemon=True).start())

    def run(self, animate: bool = True) -> race.Race | None:
        """Measure both, then (with `animate`) replay them; blocking."""
        try:
            settings = (self.prompt.value, self.policy.value, self.budget.value, self.max_new_tokens.value)
            for raced in race.run_race(self.vm, *settings):
                self.raced, self.board.value = raced, race.progress_text(raced)
        except dyspec.DyspecError as e:
            self.error.value = f"<span style='color:#D55E00'>{e}</span>"
            return None
        self.error.value = ""
        self.replay(animate)
        return self.raced

    def replay(self, animate: bool = True) -> None:
        """The race on its measured clocks, at the chosen pace (`animate=False`: its finish only)."""
        if self.raced is None:
            return
        model = self.vm.latency_model(*self.pricing.values())
        for t in race.frame_times(self.raced, self.pace.value) if animate else [self.raced.seconds]:
            self.board.value = race.race_frame(self.vm, self.raced, t, model)
            time.sleep(race.FRAME_S if animate else 0)

    def widget(self) -> W.Widget:
        return W.VBox(
            [
                W.HBox([self.example, self.expect]),
                self.prompt,
                W.HBox([self.policy, self.budget, self.max_new_tokens]),
                W.HBox([self.pace, self.pricing.widget()]),
                W.HBox([self.run_button, self.replay_button]),
                self.error,
                self.board,
            ]
        )

    def _ipython_display_(self) -> None:
        display(self.widget())
