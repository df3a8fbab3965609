"""The view model behind both front ends, the web app (app.py) and the notebook dashboard
(widgets/): the pair, its caches and warm-up, the limits, the policy and hardware menus, how a live
run and a side-by-side replay run, and every line of text they show. The front ends are layout and
bindings over it, so a new control or statistic changes one place. Text comes as HTML fragments,
which Gradio's Markdown and ipywidgets' HTML both render."""

from __future__ import annotations

import functools
import html
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from dyspec import figures
from dyspec.auto import profile, whatif
from dyspec.auto.budget import AUTO_CAP
from dyspec.cache import cache_dir
from dyspec.core.events import GenerationFinished, StepVerified
from dyspec.decode.engine import MAX_BUDGET, MAX_TEMPERATURE, Knobs, check_settings, stream
from dyspec.decode.replay import ReplayRun, Trace, record_trace, replay
from dyspec.defaults import Defaults, defaults_for, options_text
from dyspec.errors import DyspecError
from dyspec.eval import bench, speedup
from dyspec.eval.sweep import REPLAY_NOTE
from dyspec.export import run_snippet
from dyspec.load import ModelPair
from dyspec.policies import available_policies, get_policy, replayable
from dyspec.views import share

# the side-by-side view opens on trees of one size from a chain, the optimal static tree and the
# dynamic one, priced on an H100: where DySpec's tree beats a static one of the same size
SIDE_BY_SIDE = ("chain", "sequoia", "dyspec")
SIDE_BY_SIDE_BUDGET = 32
SIDE_BY_SIDE_HARDWARE = "h100-8b"
SWEEP_BUDGETS = (2, 4, 8, 16, 32, 64, 128, 256)
SWEEP_MAX = 128  # the sweep chart's largest budget: bigger replays take long for one more point
# the parametric accelerator the what-if menus open on: t(n) flat up to WIDTH tokens, a draft
# forward DRAFT_FRACTION of t(1)
WIDTH, DRAFT_FRACTION = 64, 0.1
# While a generation runs, the text and stats update at most every STREAM_S and the figures every
# REDRAW_S (both always at its end): drawing takes cores from the decoding that the speedup
# measures, and a browser that falls behind the run shows (and stops) it late.
STREAM_S = 0.1
REDRAW_S = 1.0
MAX_SIDE_BY_SIDE = 4  # trees shown at once
REPLAYS_KEPT = 512  # replayed runs a view model keeps before it forgets them all
BELOW_ONE = "below 1x = slower than plain decoding"
FEATURED = "The tree shown is the step that accepted the most drafted tokens"
# why a run ended (`GenerationFinished.stop_reason`), in words
STOP_REASONS = {"eos": "the answer ended", "max_new_tokens": "the token limit", "stopped": "stopped"}
MOVE_STEP = "; move Step to see any other."  # where there is a Step slider: not on a downloaded page


@dataclass(frozen=True)
class Limits:
    """What a web user may ask for: a live run's tree costs its forward on this machine, so on a CPU
    it stops at 64 nodes (bigger ones take seconds a step; the side-by-side replay draws them)."""

    budget: int
    replay_budget: int = MAX_BUDGET
    max_new_tokens: int = 256
    prompt_chars: int = 4000
    temperature: float = MAX_TEMPERATURE


def limits_for(pair: ModelPair) -> Limits:
    return Limits(budget=64 if pair.device.type == "cpu" else MAX_BUDGET)


@dataclass
class Live:
    """A live run so far: its steps, `ar`'s on the same prompt (empty when not measured), and the
    final event once it is over."""

    steps: list[StepVerified] = field(default_factory=list)
    ar: list[StepVerified] = field(default_factory=list)
    finished: GenerationFinished | None = None
    repeats: list[float] = field(default_factory=list)  # the speedups measured so far with these settings
    policy: str = ""
    options: dict = field(default_factory=dict)  # what the policy ran with beyond its own defaults
    prompt: str = ""
    status: str = ""  # what the run is doing before its first step, in words
    made_on: str = ""  # the machine a loaded run was measured on; empty: this one

    @property
    def where(self) -> str:
        return f"on the machine it ran on ({self.made_on})" if self.made_on else "on this machine"


def pricing_note(model_name: str) -> str:
    """How a modelled speedup was made: on another machine's profile it was never run there; on this
    machine's it prices the forwards alone, which the run also measured."""
    if model_name == whatif.THIS_MACHINE:
        return "this machine's forwards as its profile times them"
    return "not run there"


def retuned(live: Live) -> bool:
    """Whether a run's budget or temperature changed while it ran (`Knobs`)."""
    return len({(s.budget, s.temperature) for s in live.steps}) > 1


def settings_text(live: Live) -> str:
    """Which policy, budget and temperature made what is on screen, and the steps where a change
    made while it ran took effect."""
    last = live.steps[-1]
    setting = f"<b>{html.escape(live.policy)}</b>{html.escape(options_text(live.options))}"
    text = f"{setting} at budget {last.budget}, temperature {last.temperature:g}"
    sizes = [len(s.tokens) - 1 for s in live.steps if s.budget == "auto"]
    if sizes:  # what auto chose: on a CPU often one node, or none, where a tree does not pay
        text += (
            f" (auto drafted {sum(sizes) / len(sizes):.1f} tokens a step, {min(sizes)} to {max(sizes)}, "
            "as many as pay on this machine)"
        )
    changes = [
        f"step {s.step}: budget {s.budget}, temperature {s.temperature:g}"
        for before, s in zip(live.steps, live.steps[1:])
        if (before.budget, before.temperature) != (s.budget, s.temperature)
    ]
    return text + (f" (changed while it ran, from {'; '.join(changes)})" if changes else "")


def at_position(steps: Sequence[StepVerified], position: int) -> StepVerified:
    """The step whose tree drafted the answer's token `position` (the last step past the end)."""
    done = 0
    for s in steps:
        done += len(s.emitted)
        if position < done:
            return s
    return steps[-1]


def answer_position(runs: Sequence[ReplayRun], position: float | str | None) -> int:
    """A position typed or dragged along the replayed answer as a token index: one past either end is
    that end, and one that is not a number is the first token."""
    try:
        at = int(float(position))
    except (TypeError, ValueError):
        at = 0
    return min(max(at, 0), runs[0].tokens - 1)


def featured_step(steps: Sequence[StepVerified]) -> int:
    """The step a finished run shows first: the one that accepted the most drafted tokens (the
    earliest of those), rather than the last, which is often the end of the turn."""
    return max(range(len(steps)), key=lambda i: (len(steps[i].accepted), -i)) if steps else 0


def shown_step(live: Live) -> int:
    """The step whose tree a view shows: the last while the run streams, its featured one after."""
    return len(live.steps) - 1 if live.finished is None and live.steps else featured_step(live.steps)


def identity_text(live: Live) -> str:
    """Whether a greedy run's text is token for token plain decoding's on the same prompt, the
    promise of speculative decoding, checked where both were measured at T = 0."""
    greedy = all(s.temperature == 0 for s in live.steps)
    if not live.ar or not live.steps or not greedy:
        return ""
    ours, plain = ([t for s in run for t in s.emitted] for run in (live.steps, live.ar))
    n = min(len(ours), len(plain))
    if ours[:n] == plain[:n]:
        return f"Same text as plain decoding, token for token ({n} tokens compared)."
    first = next(i for i in range(n) if ours[i] != plain[i])
    return f"<b>Differs from plain decoding from token {first}</b>: please report it with the downloaded run."


def paced(runs: Iterable[Live]) -> Iterator[tuple[Live, bool]]:
    """The states of a live run worth showing, each with whether its figures are due: its states
    up to the first step and its last, the others at most every STREAM_S; figures every REDRAW_S."""
    shown = drawn = -math.inf
    for live in runs:
        now, last = time.perf_counter(), live.finished is not None
        if len(live.steps) > 1 and not last and now - shown < STREAM_S:
            continue
        draw = bool(live.steps) and (last or now - drawn >= REDRAW_S)
        shown, drawn = now, now if draw else drawn
        yield live, draw


def budget_of(budget: int | float, auto: bool) -> int | str:
    """The budget a front end's slider and `auto` checkbox ask for."""
    return "auto" if auto else int(budget)


@functools.lru_cache(maxsize=4)
def profiled_t1(path: str, mtime_ns: int) -> float:
    """A latency profile file's t(1), read again only when the file changes."""
    return profile.target_profiles(json.loads(Path(path).read_text()))[profile.CONTEXT][1]


class ViewModel:
    """`profiles`: latency models the operator loaded for the what-if menu, besides the shipped ones,
    this machine's and a parametric accelerator."""

    def __init__(self, pair: ModelPair, profiles: dict[str, whatif.LatencyModel] | None = None):
        self.pair = pair
        self.limits = limits_for(pair)
        self.policies = available_policies(pair)
        defaults = defaults_for(pair.device, pair.int8_kernel)
        self.defaults = defaults if defaults.policy in self.policies else Defaults("ar", 1, ())
        self.default_policy, self.default_budget = self.defaults.policy, self.defaults.budget
        self.replay_policies = [p for p in self.policies if p != "ar" and replayable(p)]  # side by side
        self.side_by_side = [p for p in SIDE_BY_SIDE if p in self.policies] or self.policies[:1]
        self.racers = [p for p in self.policies if p != "ar"]  # what the race runs against ar
        self.first_racer = self.default_policy if self.default_policy in self.racers else self.racers[0]
        self.hardware = {**whatif.shipped_models(), **(profiles or {})}
        self.hardware_choices = [*self.hardware, whatif.THIS_MACHINE, whatif.PARAMETRIC]
        # the menus' (label, choice) pairs: a profile by the name it gives itself, not its file's
        names = {whatif.THIS_MACHINE: "this machine (measured here)", whatif.PARAMETRIC: "a parametric accelerator"}
        self.hardware_menu = [(names.get(c) or self.hardware[c].name, c) for c in self.hardware_choices]
        # the side-by-side view prices its trees on SIDE_BY_SIDE_HARDWARE where it ships, else the first
        self.side_by_side_hardware = SIDE_BY_SIDE_HARDWARE if SIDE_BY_SIDE_HARDWARE in self.hardware else None
        self.ar_cache: dict = {}  # ar's measured steps per prompt and settings, and which policies ran warm
        self.traces: dict[tuple[str, int], Trace] = {}
        self.replays: dict[tuple, ReplayRun] = {}  # per prompt, length, policy and budget: replays are exact
        self.speedups: dict[tuple, list[float]] = {}  # measured per prompt and settings: their spread
        self.hidden_ids = frozenset(pair.tokenizer.all_special_ids)  # not printed in the text
        self.profile_paths: dict[str, Path] = {}  # this pair's latency profile, per cache folder

    @staticmethod
    def policy_line(policy: str) -> str:
        """What a policy does, in one line for a newcomer."""
        return get_policy(policy).summary

    def policy_lines(self, policies: Sequence[str]) -> str:
        """A Markdown list of what each policy does."""
        return "\n".join(f"- `{p}`: {self.policy_line(p)}" for p in policies)

    @property
    def default_text(self) -> str:
        return self.defaults.text

    def check(self, prompt: str, budget: int | str, temperature: float, max_new_tokens: int, replay=False) -> None:
        """A web user's request within the limits, before anything runs or any output changes."""
        limits = self.limits
        top = limits.replay_budget if replay else limits.budget
        if not prompt.strip():
            raise DyspecError("Type a prompt first.")
        if len(prompt) > limits.prompt_chars:
            raise DyspecError(f"The prompt is limited to {limits.prompt_chars} characters here.")
        if budget != "auto" and not 1 <= budget <= top:
            raise DyspecError(f"Budget must be 1-{top}{'' if replay else ' or auto'} here.")
        if not 1 <= max_new_tokens <= limits.max_new_tokens:
            raise DyspecError(f"Max new tokens must be 1-{limits.max_new_tokens}.")
        if not 0 <= temperature <= limits.temperature:
            raise DyspecError(f"Temperature must be between 0 and {limits.temperature}.")

    def check_policies(self, policies: Sequence[str], most: int = 1) -> None:
        if not policies:
            raise DyspecError("Pick at least one policy.")
        if len(policies) > most:
            raise DyspecError(f"Pick at most {most} policies.")
        if unknown := [p for p in policies if p not in self.policies]:
            raise DyspecError(f"Unknown policy {unknown[0]!r}; choose among: {', '.join(self.policies)}.")

    def warm_up(self, policy: str | None = None, budget: int | str | None = None) -> None:
        """One short generation of `ar` and `policy` (the default one), so that no measured run pays a
        first run's one-off costs (dyspec.eval.speedup)."""
        speedup.warm_up(self.pair, policy or self.default_policy, budget or self.default_budget, self.ar_cache)

    def run(
        self,
        prompt: str,
        policy: str,
        budget: int | str,
        temperature: float = 0.0,
        seed: int = 0,
        max_new_tokens: int = 64,
        options: dict | None = None,
        measure_ar: bool = True,
        stop: Callable[[], bool] | None = None,
        knobs: Knobs | None = None,
    ) -> Iterator[Live]:
        """A live run, the state after each step and once at its end; `ar` measured right before it
        on the same prompt and settings when `measure_ar` (speedup.ar_steps, `fresh`). With `knobs`
        (`self.knobs`), `budget` and `temperature` are its values, and `tune` changes them while
        the run goes on."""
        if knobs is not None:
            budget, temperature = knobs.budget, knobs.temperature
        self.check(prompt, budget, temperature, max_new_tokens)
        self.check_policies([policy])
        # the default policy runs with the default's options, so the policy a page opens on is the
        # default setting; options given (a front end's controls) go on top
        options = {**(self.defaults.options if policy == self.default_policy else {}), **(options or {})}
        live = Live(policy=policy, options=options, prompt=prompt)
        if measure_ar and policy != "ar":
            live.status = "Measuring ar (plain decoding) on this prompt first, right before the run, for the speedup."
            yield live
            self.warm_up(policy, budget)
            live.ar = speedup.ar_steps(self.pair, prompt, temperature, seed, max_new_tokens, self.ar_cache, fresh=True)
        live.status = f"Running {policy}: the first step comes after the prompt is read."
        yield live
        kwargs = {"temperature": temperature, "seed": seed, "max_new_tokens": max_new_tokens, "options": options}
        for event in stream(self.pair, prompt, policy, budget, stop=stop, knobs=knobs, **kwargs):
            if isinstance(event, StepVerified):
                live.steps.append(event)
            elif isinstance(event, GenerationFinished):
                live.finished = event
                # a run whose knobs moved while it ran repeats no setting
                if live.ar and event.stop_reason != "stopped" and not retuned(live):
                    key = (prompt, policy, budget, repr(kwargs))
                    live.repeats = self.speedups.setdefault(key, [])
                    live.repeats.append(speedup.decode_rate(live.steps) / speedup.decode_rate(live.ar))
            yield live

    def knobs(self, budget: int | str, temperature: float) -> Knobs:
        """A live run's settings that `tune` may change while it runs, up to this machine's limit."""
        return Knobs(budget, temperature, most=max(self.limits.budget, AUTO_CAP))

    def tune(
        self, knobs: Knobs, policy: str, budget: int | str, temperature: float, options: dict | None = None
    ) -> None:
        """A running generation's budget and temperature, from its next step; checked first."""
        if isinstance(budget, int) and budget > self.limits.budget:
            raise DyspecError(f"The budget is at most {self.limits.budget} here.")
        check_settings(policy, budget, temperature, 1, dict(options or {}))
        knobs.budget, knobs.temperature = budget, temperature

    def stats(self, live: Live, page: bool = False) -> str:
        """What a live run did, with which settings, and its speedup measured against `ar` on this
        machine; `page`: as a downloaded page says it, which has no Step slider."""
        steps, tokens = live.steps, sum(len(s.emitted) for s in live.steps)
        if not steps and live.finished is None:
            return live.status
        lines = [settings_text(live)] if steps else []
        lines += [
            f"<b>{tokens} tokens in {len(steps)} target forwards</b> ({tokens / max(len(steps), 1):.2f} tokens "
            f"per forward), {speedup.decode_rate(steps):.1f} tokens/s while decoding"
        ]
        if steps:
            lines.append(speedup.step_split_text(steps, live.ar))
        if live.ar:
            shown = speedup.speedup_text(steps, live.ar, live.finished is not None, self.here_ms(live))
            lines.append(
                f"Measured speedup vs ar (plain decoding, {speedup.decode_rate(live.ar):.1f} tokens/s) "
                f"{live.where}: <b>{shown}</b>; {BELOW_ONE}; {speedup.METHOD}."
            )
        if len(live.repeats) > 1:
            runs = ", ".join(f"{r:.2f}x" for r in live.repeats)
            lines.append(
                f"The same settings measured {len(live.repeats)} times here: {runs} (a spread of "
                f"{max(live.repeats) - min(live.repeats):.2f}x: the machine's noise, the answer is the same)."
            )
        elif live.repeats and not page:
            lines.append("Run it again to see how much repeated measurements differ on this machine.")
        elif live.finished is not None and retuned(live):
            lines.append("Its budget or temperature changed while it ran, so it repeats no earlier run.")
        if identity := identity_text(live):
            lines.append(identity)
        if live.finished is not None:
            why = STOP_REASONS.get(live.finished.stop_reason, live.finished.stop_reason)
            lines.append(f"Done ({why}): {live.finished.wall_s:.2f} s wall, prefill included.")
            lines += [FEATURED + ("." if page else MOVE_STEP)] if steps else []
        return "<br>".join(lines)

    def profile_ms(self) -> float | None:
        """This machine's profiled t(1) of the target, where the profile is already measured (it is
        not measured for this: that takes a minute), to check `ar`'s forwards against. Asked on
        every streamed step: the path (versions and kernel read, a millisecond) is found once per
        cache folder, the file read once per version of it."""
        folder = str(cache_dir())
        if folder not in self.profile_paths:
            self.profile_paths[folder] = profile.profile_path(self.pair)
        path = self.profile_paths[folder]
        return profiled_t1(str(path), path.stat().st_mtime_ns) if path.exists() else None

    def here_ms(self, live: Live) -> float | None:
        """`profile_ms` for a run made on this machine; a loaded run's ran on another."""
        return None if live.made_on else self.profile_ms()

    def latency_model(
        self, choice: str, width: int = WIDTH, draft_fraction: float = DRAFT_FRACTION
    ) -> whatif.LatencyModel:
        return whatif.choose_model(choice, self.pair, self.hardware, int(width), float(draft_fraction))

    def replay_models(
        self, choice: str, width: int = WIDTH, draft_fraction: float = DRAFT_FRACTION
    ) -> list[whatif.LatencyModel]:
        """This machine's latency model and the chosen one, once each: the replay table's columns."""
        models = [self.latency_model(whatif.THIS_MACHINE), self.latency_model(choice, width, draft_fraction)]
        return list({m.name: m for m in models}.values())

    def whatif(self, live: Live, choice: str, width: int = WIDTH, draft_fraction: float = DRAFT_FRACTION) -> str:
        """The run measured here and modelled elsewhere, one line each, each saying which it is."""
        if not live.steps:
            return "Run a generation to price its trees."
        here = speedup.measured_speedup(live.steps, live.ar) if live.ar else None
        if here:
            busy = speedup.busy_text(live.steps, live.ar, self.here_ms(live))
            measured = f"<b>{here.ratio:.2f}x</b> vs ar" + (f" ({busy})" if busy else "")
        elif live.finished is not None and live.finished.policy == "ar":
            measured = "1.00x: this run is ar, plain decoding"
        else:
            measured = "not measured (measuring ar on the same prompt was off)"
        model = self.latency_model(choice, width, draft_fraction)
        shapes = whatif.step_shapes(live.steps)
        modelled = whatif.modelled_speedup(shapes, model)
        text = (
            f"Measured {live.where}: {measured}.<br>Modelled on {model.name}: <b>{modelled:.2f}x</b> vs ar, "
            f"from this run's trees with a latency profile ({pricing_note(model.name)}); {BELOW_ONE}."
        )
        # the profile prices forwards, a step is more; a loaded run's steps ran on another machine
        if model.name == whatif.THIS_MACHINE and live.ar and not live.made_on:
            other, ar_other = (1e3 * sum(s.overhead_s for s in r) / len(r) for r in (live.steps, live.ar))
            whole = whatif.modelled_speedup(shapes, model, other, ar_other)
            text += (
                f" The profile prices forwards only: with the {other:.1f} ms a step this run spent building, "
                f"verifying and committing (ar: {ar_other:.1f} ms), the model gives <b>{whole:.2f}x</b>; "
                "the rest of the gap to the measured figure is forwards that ran slower in the run than alone."
            )
        return text

    def download(self, live: Live, choice: str, width: int = WIDTH, draft_fraction: float = DRAFT_FRACTION) -> str:
        """The run as one HTML page to share: its stats, text, what-if and figures, offline, with
        its record for `load` (dyspec.views.share)."""
        if not live.steps:
            raise DyspecError("Run a generation first: there is nothing to download yet.")
        made_on = live.made_on or bench.host_stamp(self.pair, None)["host"]
        record = share.run_record(live.policy, live.options, live.prompt, live.steps, live.ar, live.finished, made_on)
        best = live.steps[featured_step(live.steps)]
        # the page is read elsewhere: its machine by name, not "this machine"
        named = replace(live, made_on=made_on)
        sections = [
            f"<p><b>Prompt:</b> {html.escape(live.prompt)}</p>",
            f"<p>{self.stats(named, page=True)}</p>",
            self.text(live.steps),
            f"<p>{self.whatif(named, choice, width, draft_fraction)}</p>",
        ]
        figs = [figures.tree_figure(best), self.steps_chart(live), self.depth_chart(live.steps)]
        return share.run_page(f"dyspec: {live.policy} on {made_on}", sections, figs, record)

    def load(self, text: str | bytes) -> Live:
        """A run downloaded by `download` (its page or its bare record), checked, as a finished run."""
        record = share.parse_record(text)
        live = Live(policy=record["policy"], prompt=record["prompt"], made_on=str(record["made_on"]))
        live.options = dict(record.get("options") or {})
        live.steps, live.ar = share.steps_from(record["steps"], "steps"), share.steps_from(record["ar"], "ar")
        live.finished = share.finished_from(record.get("finished"))
        if not live.steps:
            raise DyspecError(f"{share.NOT_A_RUN}: it has no steps.")
        return live

    def loaded_settings(self, live: Live) -> tuple:
        """The controls a loaded run sets, so that the next Run runs what it shows: (policy, budget,
        auto, temperature, seed, max new tokens) as it started, None for each this pair cannot take
        (another pair's policy, a budget or length past this app's limits) or the run does not say."""
        f = live.finished
        if f is None:
            return (None,) * 6
        auto = f.budget == "auto"
        budget = None if auto or not 1 <= int(f.budget) <= self.limits.budget else int(f.budget)
        ran_out = f.stop_reason == "max_new_tokens" and f.new_tokens <= self.limits.max_new_tokens
        length = f.new_tokens if ran_out else None
        return (
            f.policy if f.policy in self.policies else None,
            budget,
            auto,
            f.temperature if 0 <= f.temperature <= self.limits.temperature else None,
            f.seed,
            length,
        )

    def text(self, steps: Sequence[StepVerified], step: int | None = None) -> str:
        """The run's text, the tokens that step `step` committed outlined."""
        start = sum(len(s.emitted) for s in steps[:step]) if step is not None else 0
        marked = range(start, start + len(steps[step].emitted)) if step is not None else ()
        return figures.text_html(steps, self.hidden_ids, marked)

    @staticmethod
    def depth_chart(steps: Sequence[StepVerified]):
        """Acceptance by tree depth over the run's (or a replay's) steps."""
        return figures.depth_figure(*figures.depth_counts(steps))

    def steps_chart(self, live: Live):
        """Tokens per forward at each step, and the running speedup over `ar` where it was measured."""
        ar_rate = speedup.decode_rate(live.ar) if live.ar else None
        return figures.steps_figure(live.steps, speedup.running_speedup(live.steps, ar_rate) if ar_rate else None)

    @staticmethod
    def export(live: Live, fmt: str) -> str:
        """The run's tree shapes in a serving engine's format (dyspec.export)."""
        if not live.steps:
            return "# run a generation first"
        return run_snippet([s.parents for s in live.steps], fmt)

    @staticmethod
    def position_trees(runs: Sequence[ReplayRun], position: int) -> list:
        """Each run's tree that drafted the answer's token `position`, titled with its policy and step."""
        return [
            figures.tree_figure(step, title=f"{r.policy} at {r.budget}: step {step.step}")
            for r in runs
            for step in [at_position(r.steps, position)]
        ]

    def position_text(self, runs: Sequence[ReplayRun], position: int) -> str:
        """The replayed answer (every run's: the target's own greedy one), its token `position` outlined."""
        return figures.text_html(runs[0].steps, self.hidden_ids, mark=(position,)) if runs else ""

    def sweep_status(self, prompt: str, policies: Sequence[str], max_new_tokens: int) -> str:
        """What the sweep chart waits for, while it is computed; "" once it is kept."""
        budgets = [b for b in SWEEP_BUDGETS if b <= SWEEP_MAX]
        left = [(p, b) for p in policies for b in budgets if (prompt, max_new_tokens, p, b) not in self.replays]
        if not left:
            return ""
        return (
            f"Replaying {len(left)} more trees for the chart below (budgets {budgets[0]} to {budgets[-1]} for "
            f"{', '.join(policies)}): big trees take a while on a CPU; each is kept, so this happens once."
        )

    def sweep(self, prompt: str, policies: Sequence[str], max_new_tokens: int) -> tuple[list[ReplayRun], object]:
        """The policies replayed at every budget of SWEEP_BUDGETS up to SWEEP_MAX, and their chart."""
        runs = self.replay(prompt, policies, [b for b in SWEEP_BUDGETS if b <= SWEEP_MAX], max_new_tokens)
        return runs, figures.sweep_figure(runs)

    def trace(self, prompt: str, max_new_tokens: int) -> Trace:
        """The target's greedy answer to `prompt`, recorded once; its steps are `ar`'s at T = 0."""
        key = (prompt, max_new_tokens)
        if key not in self.traces:
            self.warm_up("ar", 1)
            self.traces[key] = record_trace(self.pair, prompt, max_new_tokens)
            self.ar_cache.setdefault(speedup.ar_key(prompt, 0.0, 0, max_new_tokens), self.traces[key].steps)
        return self.traces[key]

    def replay(
        self, prompt: str, policies: Sequence[str], budgets: Sequence[int], max_new_tokens: int = 64
    ) -> list[ReplayRun]:
        """Each policy at each budget along the prompt's trace (T = 0; times modelled, never measured)."""
        self.check_policies(policies, MAX_SIDE_BY_SIDE)
        for budget in budgets:
            self.check(prompt, budget, 0.0, max_new_tokens, replay=True)
        trace = self.trace(prompt, max_new_tokens)
        if len(self.replays) > REPLAYS_KEPT:
            self.replays.clear()
        for p in policies:  # a replay is deterministic: one per settings serves every later view
            for b in budgets:
                if (key := (prompt, max_new_tokens, p, b)) not in self.replays:
                    self.replays[key] = replay(self.pair, trace, [p], [b], progress=False)[0]
        return [self.replays[prompt, max_new_tokens, p, b] for p in policies for b in budgets]

    def replay_table(self, runs: Sequence[ReplayRun], models: Sequence[whatif.LatencyModel]) -> str:
        """Per run: drafted nodes per tree (a budget is a cap: a policy may draft fewer), tokens per
        forward, draft forwards per step and the speedup modelled on each of `models`, below a row for
        `ar`, the baseline (one token a forward, its own speed by definition)."""
        head = "| policy | budget | nodes a tree | tokens a target forward | draft forwards a step |"
        head += "".join(f" modelled on {m.name} |" for m in models)
        rows = [head, "|---|---|---|---|---|" + "---|" * len(models)]
        rows.append("| ar (baseline) | - | 0 | 1.00 | 0 |" + " 1.00x |" * len(models))
        for r in runs:
            steps = max(len(r.steps), 1)
            cells = "".join(f" {whatif.modelled_speedup(whatif.step_shapes(r.steps), m):.2f}x |" for m in models)
            rows.append(
                f"| {r.policy} | {r.budget} | {sum(len(s.tokens) - 1 for s in r.steps) / steps:.1f} | "
                f"{r.tokens_per_forward:.2f} | {r.draft_forwards / steps:.1f} |{cells}"
            )
        return "\n".join(rows) + "\n\n" + REPLAY_NOTE
