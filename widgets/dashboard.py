"""A notebook dashboard: type a prompt, move the budget or temperature, run, and watch the token tree
grow, get verified, and pay off against autoregressive decoding. The figures come from
`dyspec.views.figures`, the same functions the web app uses; the dashboard keeps them as plotly figures
(`tree_fig`, `steps_fig`, `calibration_fig`) so they can be inspected from Python and in tests.
"""

from __future__ import annotations

import os
import threading
import time

import ipywidgets as W
import plotly.graph_objects as go
from IPython.display import display

import dyspec
from dyspec.auto import whatif
from dyspec.core.events import GenerationFinished, StepVerified
from dyspec.defaults import defaults_for
from dyspec.eval import speedup
from dyspec.export import VIEW_FORMATS, run_snippet
from dyspec.policies import available_policies
from dyspec.views import figures
from dyspec.views.examples import EXAMPLES

# While a generation runs, the text and stats update every step and the figures at most this often
# (always once at its end): a browser drawing three plotly figures takes cores from the decoding
# that the speedup measures. On 2 cores even that costs most of the speedup (JupyterLab in headless
# Chromium: 0.3x against 1.7x with figures drawn at the end), so there the figures wait for the end
# unless the user asks for them live.
REDRAW_S = 1.0
LIVE_FIGURES = (os.cpu_count() or 1) > 2


class Dashboard:
    """`profiles`: latency models (`dyspec.auto.whatif.load_profile`) for the what-if menu, besides the
    shipped ones, this machine's and a parametric accelerator. `ar_cache` keeps `ar`'s measured steps
    per prompt and settings; dashboards on one pair may share one."""

    def __init__(
        self,
        pair: dyspec.ModelPair,
        prompt: str | None = None,
        profiles: dict | None = None,
        ar_cache: dict | None = None,
    ):
        self.pair = pair
        self.steps: list[StepVerified] = []
        self.ar_steps: list[StepVerified] = []
        self.finished: GenerationFinished | None = None
        self.ar_cache = {} if ar_cache is None else ar_cache
        self.hardware = {**whatif.shipped_models(), **(profiles or {})}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        policies = available_policies(pair)
        defaults = defaults_for(pair.device)
        self.example = W.Dropdown(
            options=[("(your own prompt)", None), *((e.label, e) for e in EXAMPLES)],
            value=None if prompt else EXAMPLES[0],
            description="Example",
        )
        self.expect = W.HTML()
        self.prompt = W.Textarea(
            prompt or EXAMPLES[0].prompt, description="Prompt", layout=W.Layout(width="100%", height="90px")
        )
        self.policy = W.Dropdown(
            options=policies, value=defaults.policy if defaults.policy in policies else "ar", description="Policy"
        )
        self.budget = W.IntSlider(defaults.budget, min=1, max=64, description="Budget")
        self.temperature = W.FloatSlider(0.0, min=0, max=2, step=0.05, description="Temperature")
        self.threshold = W.FloatText(0.0, description="Threshold", tooltip="dyspec-threshold's t (0: 1/budget)")
        self.h = W.FloatSlider(0.5, min=0.05, max=0.95, step=0.05, description="h", tooltip="specdecpp's stop level")
        self.max_depth = W.IntSlider(16, min=1, max=32, description="Max depth")
        self.seed = W.IntText(0, description="Seed")
        self.max_new_tokens = W.IntSlider(64, min=1, max=256, description="Max tokens")
        self.measure_ar = W.Checkbox(True, description="compare with ar (for speedup)")
        self.live_figures = W.Checkbox(LIVE_FIGURES, description="redraw figures while running")
        self.run_button = W.Button(description="Run", button_style="primary")
        self.stop_button = W.Button(description="Stop")
        self.step_slider = W.IntSlider(0, min=0, max=0, description="Step")
        self.growth_slider = W.IntSlider(1, min=1, max=1, description="Growth")
        # Replays the tree's growth: Play ticks its value in the browser, the link moves the slider.
        self.growth_play = W.Play(1, min=1, max=1, interval=400, description="Replay growth")
        W.link((self.growth_play, "value"), (self.growth_slider, "value"))
        W.link((self.growth_play, "max"), (self.growth_slider, "max"))
        choices = [*self.hardware, whatif.THIS_MACHINE, whatif.PARAMETRIC]
        self.hardware_choice = W.Dropdown(options=choices, value=choices[0], description="What-if")
        self.width = W.IntSlider(64, min=1, max=256, description="Width W", tooltip="parametric: t(n) flat up to W")
        self.draft_fraction = W.FloatSlider(0.1, min=0, max=1, step=0.01, description="Draft/t(1)")
        self.whatif = W.HTML("Run a generation to price its trees.")
        self.export_format = W.Dropdown(options=list(VIEW_FORMATS), value="trtllm", description="Export")
        self.export_button = W.Button(description="Export this tree")
        self.export_text = W.Textarea(layout=W.Layout(width="100%"), rows=3)
        self.stats = W.HTML()
        self.text = W.HTML()
        self.tree_fig = go.Figure()
        self.steps_fig = go.Figure()
        self.calibration_fig = go.Figure()
        self._tree_out, self._steps_out, self._calibration_out = W.Output(), W.Output(), W.Output()
        self.run_button.on_click(lambda _: self.start())
        self.export_button.on_click(lambda _: self.export())
        self.stop_button.on_click(lambda _: self.stop())
        self.step_slider.observe(lambda _: self.show_step(), names="value")
        self.growth_slider.observe(lambda _: self.show_step(), names="value")
        self.example.observe(lambda _: self.pick_example(), names="value")
        for control in (self.hardware_choice, self.width, self.draft_fraction):
            control.observe(lambda _: self.price(), names="value")
        self.pick_example()

    def pick_example(self) -> None:
        example = self.example.value
        if example is not None:
            self.prompt.value = example.prompt
        self.expect.value = f"<i>{example.expect}</i>" if example is not None else ""

    def price(self) -> str:
        """The what-if line for the last run under the chosen hardware (also shown)."""
        if not self.steps:
            return self.whatif.value
        model = whatif.choose_model(
            self.hardware_choice.value, self.pair, self.hardware, self.width.value, self.draft_fraction.value
        )
        here = speedup.measured_speedup(self.steps, self.ar_steps)
        measured = f"measured here: <b>{here.ratio:.2f}x</b>" if here else "measured here: (ar not measured)"
        self.whatif.value = f"{measured} &middot; <b>{whatif.whatif_line(self.steps, model)}</b>"
        return self.whatif.value

    def export(self) -> str:
        """The last run's tree shape in the chosen serving engine's format (also shown)."""
        self.export_text.value = run_snippet([s.parents for s in self.steps], self.export_format.value)
        return self.export_text.value

    def options(self) -> dict:
        """Policy options set by the controls (only those the chosen policy takes)."""
        takes = dyspec.policies.policy_options(self.policy.value)
        chosen = {"max_depth": self.max_depth.value, "h": self.h.value}
        if self.threshold.value > 0:
            chosen["threshold"] = self.threshold.value
        return {k: v for k, v in chosen.items() if k in takes}

    def run(self) -> GenerationFinished:
        """Generate with the current settings, updating the views after every step (blocking)."""
        self._stop.clear()
        self.steps, self.ar_steps, self.finished = [], [], None
        kwargs = {
            "temperature": self.temperature.value,
            "seed": self.seed.value,
            "max_new_tokens": self.max_new_tokens.value,
        }
        drawn = 0.0
        if self.measure_ar.value and self.policy.value != "ar":
            self.ar_steps = speedup.ar_steps(self.pair, self.prompt.value, cache=self.ar_cache, **kwargs)
            speedup.warm_up(self.pair, self.policy.value, self.budget.value, self.ar_cache)
        for event in dyspec.stream(
            self.pair,
            self.prompt.value,
            policy=self.policy.value,
            budget=self.budget.value,
            options=self.options(),
            stop=self._stop.is_set,
            **kwargs,
        ):
            if isinstance(event, StepVerified):
                self.steps.append(event)
                live = self.live_figures.value and time.perf_counter() - drawn >= REDRAW_S
                self._refresh(figures_too=live)
                drawn = time.perf_counter() if live else drawn
            elif isinstance(event, GenerationFinished):
                self.finished = event
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

    def show_step(self) -> None:
        if not self.steps:
            return
        step = self.steps[min(self.step_slider.value, len(self.steps) - 1)]
        self.growth_slider.max = len(step.tokens)
        self.tree_fig = figures.tree_figure(step, self.growth_slider.value)
        self._draw(self._tree_out, self.tree_fig)

    def _refresh(self, figures_too: bool = True) -> None:
        last = self.steps[-1] if self.steps else None
        self.text.value = figures.text_html(self.steps)
        ar_rate = speedup.decode_rate(self.ar_steps) if self.ar_steps else None
        tokens = sum(len(s.emitted) for s in self.steps)
        stats = (
            f"<b>{tokens} tokens in {len(self.steps)} target forwards</b>, "
            f"{speedup.decode_rate(self.steps):.1f} tokens/s decoding"
        )
        if self.ar_steps:
            shown = speedup.speedup_text(self.steps, self.ar_steps, final=self.finished is not None)
            stats += f"; speedup vs ar: <b>{shown}</b> ({speedup.METHOD}; ar {ar_rate:.1f} tokens/s)"
        if self.finished:
            stats += f" ({self.finished.stop_reason})"
        self.stats.value = stats
        if not figures_too:
            return
        running = speedup.running_speedup(self.steps, ar_rate) if ar_rate else None
        self.steps_fig = figures.steps_figure(self.steps, running)
        self.calibration_fig = figures.calibration_figure(*figures.calibration_counts(self.steps))
        if last is not None:
            with self.step_slider.hold_trait_notifications(), self.growth_slider.hold_trait_notifications():
                self.step_slider.max = len(self.steps) - 1
                self.step_slider.value = len(self.steps) - 1
                self.growth_slider.max = len(last.tokens)
                self.growth_slider.value = len(last.tokens)
            self.tree_fig = figures.tree_figure(last)
            self._draw(self._tree_out, self.tree_fig)
        self._draw(self._steps_out, self.steps_fig)
        self._draw(self._calibration_out, self.calibration_fig)

    @staticmethod
    def _draw(out: W.Output, fig: go.Figure) -> None:
        out.clear_output(wait=True)
        with out:
            fig.show()

    def widget(self) -> W.Widget:
        controls = W.VBox(
            [
                W.HBox([self.example, self.expect]),
                self.prompt,
                W.HBox([self.policy, self.budget, self.temperature]),
                W.HBox([self.threshold, self.h, self.max_depth]),
                W.HBox([self.seed]),
                W.HBox([self.max_new_tokens, self.measure_ar, self.live_figures]),
                W.HBox([self.run_button, self.stop_button]),
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
                W.HBox([self.hardware_choice, self.width, self.draft_fraction]),
                self.whatif,
                W.HBox([self.export_format, self.export_button]),
                self.export_text,
            ]
        )

    def _ipython_display_(self) -> None:
        display(self.widget())


class Compare:
    """Two dashboards side by side on the same prompt and seed."""

    def __init__(self, pair: dyspec.ModelPair, policy_a: str = "chain", policy_b: str = "dyspec"):
        self.a = Dashboard(pair)
        self.b = Dashboard(pair, ar_cache=self.a.ar_cache)
        self.a.policy.value, self.b.policy.value = policy_a, policy_b
        self.b.prompt = self.a.prompt  # one prompt box drives both
        self.b.seed = self.a.seed

    def run(self) -> tuple[GenerationFinished, GenerationFinished]:
        return self.a.run(), self.b.run()

    def _ipython_display_(self) -> None:
        display(W.HBox([self.a.widget(), self.b.widget()]))
