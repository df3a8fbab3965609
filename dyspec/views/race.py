"""The race: plain decoding (`ar`) and a policy on the same prompt, measured one after the other so
that they never share the cores, then replayed side by side on their measured clocks. Both run at
T = 0, so they write the same text; what differs is when each token arrives. The clock starts after
the prompt is read (prefill excluded, as every speedup here is)."""

from __future__ import annotations

import html
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dyspec import figures
from dyspec.auto import whatif
from dyspec.core.events import StepVerified
from dyspec.defaults import setting_text
from dyspec.eval import speedup
from dyspec.views.state import BELOW_ONE, Live, ViewModel, identity_text, pricing_note

FRAME_S = 0.1  # the replay's clock tick: ten frames a second
# the replay's speeds, labelled
PACES = [("as measured", 1.0), ("half speed", 0.5), ("quarter speed", 0.25), ("a tenth", 0.1)]


@dataclass
class Race:
    ar: Live = field(default_factory=Live)
    run: Live = field(default_factory=Live)
    budget: int | str = 1

    @property
    def setting(self) -> str:
        """The policy raced against `ar`, with its options and budget."""
        return setting_text(self.run.policy, self.run.options, self.budget)

    @property
    def seconds(self) -> float:
        """The longer runner's decoding time: how long the replay lasts."""
        return max((clock(r.steps)[-1] for r in (self.ar, self.run) if r.steps), default=0.0)


def clock(steps: list[StepVerified]) -> list[float]:
    """When each step ended, from the end of the prefill."""
    out, t = [], 0.0
    for s in steps:
        t += speedup.step_seconds(s)
        out.append(t)
    return out


def run_race(
    vm: ViewModel,
    prompt: str,
    policy: str,
    budget: int | str,
    max_new_tokens: int,
    stop: Callable[[], bool] | None = None,
) -> Iterator[Race]:
    """`ar`, then `policy`, each warm and measured alone; the race so far after every step."""
    vm.check_policies([policy])
    race = Race(budget=budget)
    vm.warm_up(policy, budget)
    for live in vm.run(prompt, "ar", 1, 0.0, 0, max_new_tokens, measure_ar=False, stop=stop):
        race.ar = live
        yield race
    if race.ar.finished is not None and race.ar.finished.stop_reason == "stopped":
        return
    for live in vm.run(prompt, policy, budget, 0.0, 0, max_new_tokens, measure_ar=False, stop=stop):
        race.run, live.ar = live, race.ar.steps  # ar's steps: for the speedup and the identity check
        yield race


def progress_text(race: Race) -> str:
    """What is being measured while the race runs, before its replay."""
    running = race.run if race.run.policy else race.ar
    tokens = sum(len(s.emitted) for s in running.steps)
    name = "ar (plain decoding)" if running is race.ar else race.setting
    return f"Measuring {name}: {tokens} tokens. The replay on their measured clocks follows."


def lane(vm: ViewModel, title: str, live: Live, t: float) -> str:
    """One runner at time `t`: its clock, its tokens so far and its text."""
    ends = clock(live.steps)
    done = [s for s, end in zip(live.steps, ends) if end <= t]
    tokens = sum(len(s.emitted) for s in done)
    finished = bool(ends) and t >= ends[-1]
    shown = ends[-1] if finished else t
    return (
        f"<div style='flex:1;min-width:0;border:1px solid #ccc;border-radius:6px;padding:8px'>"
        f"<div style='font-size:1.2em'><b>{html.escape(title)}</b></div>"
        f"<div style='font-size:1.6em;font-variant-numeric:tabular-nums'>{shown:.2f} s · {tokens} tokens"
        f"{' · done' if finished else ''}</div>"
        f"<div style='height:260px;overflow:auto'>{figures.text_html(done, vm.hidden_ids)}</div></div>"
    )


def race_frame(vm: ViewModel, race: Race, t: float, model: whatif.LatencyModel) -> str:
    """The race at `t` seconds of decoding: both lanes, and once both are done the measured ratio
    and the one modelled on `model`, each labelled."""
    lanes = lane(vm, "ar: plain decoding", race.ar, t) + lane(vm, race.setting, race.run, t)
    body = f"<div style='display:flex;gap:12px'>{lanes}</div>"
    if t < race.seconds or not race.run.steps:
        return body
    tokens = sum(len(s.emitted) for s in race.run.steps)
    if tokens < speedup.MIN_TOKENS:  # as the live tab: a few steps' luck is not a speed
        few = f"{tokens} tokens: too few for a speedup (at least {speedup.MIN_TOKENS}); race a longer answer"
        return f"<div>{few}.</div>{body}"
    ratio = speedup.decode_rate(race.run.steps) / speedup.decode_rate(race.ar.steps)
    modelled = whatif.modelled_speedup(whatif.step_shapes(race.run.steps), model)
    busy = speedup.busy_text(race.run.steps, race.ar.steps, vm.profile_ms())
    return (
        f"<div style='display:flex;gap:24px;align-items:baseline;margin-bottom:8px'>"
        f"<div><span style='font-size:3em;font-weight:bold'>{ratio:.2f}x</span> measured {race.run.where}</div>"
        f"<div><span style='font-size:2em'>{modelled:.2f}x</span> modelled on {html.escape(model.name)} "
        f"from these trees ({pricing_note(model.name)})</div></div>"
        f"<div>{BELOW_ONE}. {identity_text(race.run)}{' ' + busy + '.' if busy else ''}</div>" + body
    )


def frame_times(race: Race, pace: float = 1.0) -> Iterator[float]:
    """The replay's clock, FRAME_S apart in wall time at `pace` (1: as measured; 0.5: half speed),
    ending on the finish."""
    t, step = 0.0, FRAME_S * pace
    while t < race.seconds:
        yield t
        t += step
    yield race.seconds
