"""A notebook dashboard: type a prompt, move the budget or temperature, run, and watch the token tree
grow, get verified, and pay off against autoregressive decoding. The figures come from
`dyspec.figures`, the same functions the web app uses; the dashboard keeps them as plotly figures
(`tree_fig`, `steps_fig`, `calibration_fig`) so they can be inspected from Python and in tests.
"""

from __future__ import annotations

import threading

import ipywidgets as W
import plotly.graph_objects as go
from IPython.display import display

import dyspec
from dyspec import figures
from dyspec.events import GenerationFinished, StepVerified
from dyspec.policies import available_policies


class Dashboard:
    def __init__(self, pair: dyspec.ModelPair, prompt: str = "Explain speculative decoding in one paragraph."):
        self.pair = pair
        self.steps: list[StepVerified] = []
        self.finished: GenerationFinished | None = None
        self.ar_tokens_per_s: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        policies = available_policies(pair)
        self.prompt = W.Textarea(prompt, description="Prompt", layout=W.Layout(width="100%", height="70px"))
        self.policy = W.Dropdown(
            options=policies, value="dyspec" if "dyspec" in policies else "ar", description="Policy"
        )
        self.budget = W.IntSlider(8, min=1, max=64, description="Budget")
        self.temperature = W.FloatSlider(0.0, min=0, max=2, step=0.05, description="Temperature")
        self.threshold = W.FloatText(0.0, description="Threshold", tooltip="dyspec-threshold's t (0: 1/budget)")
        self.h = W.FloatSlider(0.5, min=0.05, max=0.95, step=0.05, description="h", tooltip="specdecpp's stop level")
        self.max_depth = W.IntSlider(16, min=1, max=32, description="Max depth")
        self.seed = W.IntText(0, description="Seed")
        self.max_new_tokens = W.IntSlider(64, min=1, max=256, description="Max tokens")
        self.measure_ar = W.Checkbox(True, description="measure ar first (for speedup)")
        self.run_button = W.Button(description="Run", button_style="primary")
        self.stop_button = W.Button(description="Stop")
        self.step_slider = W.IntSlider(0, min=0, max=0, description="Step")
        self.growth_slider = W.IntSlider(1, min=1, max=1, description="Growth")
        # Replays the tree's growth: Play ticks its value in the browser, the link moves the slider.
        self.growth_play = W.Play(1, min=1, max=1, interval=400, description="Replay growth")
        W.link((self.growth_play, "value"), (self.growth_slider, "value"))
        W.link((self.growth_play, "max"), (self.growth_slider, "max"))
        self.stats = W.HTML()
        self.text = W.HTML()
        self.tree_fig = go.Figure()
        self.steps_fig = go.Figure()
        self.calibration_fig = go.Figure()
        self._tree_out, self._steps_out, self._calibration_out = W.Output(), W.Output(), W.Output()
        self.run_button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self.stop())
        self.step_slider.observe(lambda _: self.show_step(), names="value")
        self.growth_slider.observe(lambda _: self.show_step(), names="value")

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
        self.steps, self.finished = [], None
        kwargs = {
            "temperature": self.temperature.value,
            "seed": self.seed.value,
            "max_new_tokens": self.max_new_tokens.value,
        }
        self.ar_tokens_per_s = None
        if self.measure_ar.value and self.policy.value != "ar":
            ar = dyspec.generate(self.pair, self.prompt.value, policy="ar", **kwargs)
            self.ar_tokens_per_s = ar.decode_tokens_per_s
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
                self._refresh()
            elif isinstance(event, GenerationFinished):
                self.finished = event
        self._refresh()
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

    def _refresh(self) -> None:
        last = self.steps[-1] if self.steps else None
        self.text.value = figures.text_html(self.steps)
        self.steps_fig = figures.steps_figure(self.steps, self.ar_tokens_per_s)
        self.calibration_fig = figures.calibration_figure(*figures.calibration_counts(self.steps))
        tokens = sum(len(s.emitted) for s in self.steps)
        seconds = sum(s.draft_s + s.target_s + s.overhead_s for s in self.steps) or 1e-9
        stats = f"<b>{tokens} tokens in {len(self.steps)} target forwards</b>, {tokens / seconds:.1f} tokens/s decoding"
        if self.ar_tokens_per_s:
            stats += f"; <b>{tokens / seconds / self.ar_tokens_per_s:.2f}x</b> ar's rate on this prompt"
        if self.finished:
            stats += f" ({self.finished.stop_reason})"
        self.stats.value = stats
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
                self.prompt,
                W.HBox([self.policy, self.budget, self.temperature]),
                W.HBox([self.threshold, self.h, self.max_depth]),
                W.HBox([self.seed]),
                W.HBox([self.max_new_tokens, self.measure_ar]),
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
            ]
        )

    def _ipython_display_(self) -> None:
        display(self.widget())


class Compare:
    """Two dashboards side by side on the same prompt and seed."""

    def __init__(self, pair: dyspec.ModelPair, policy_a: str = "chain", policy_b: str = "dyspec"):
        self.a, self.b = Dashboard(pair), Dashboard(pair)
        self.a.policy.value, self.b.policy.value = policy_a, policy_b
        self.b.prompt = self.a.prompt  # one prompt box drives both
        self.b.seed = self.a.seed

    def run(self) -> tuple[GenerationFinished, GenerationFinished]:
        return self.a.run(), self.b.run()

    def _ipython_display_(self) -> None:
        display(W.HBox([self.a.widget(), self.b.widget()]))
