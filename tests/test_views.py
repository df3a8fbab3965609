"""The view model's workshop views, driven as both front ends drive them: a shared run downloaded
and loaded back, the race, and the words that explain a run."""

import dataclasses
import json
import re

import pytest

from dyspec import figures
from dyspec.core.events import StepVerified
from dyspec.decode.replay import ReplayRun
from dyspec.errors import DyspecError
from dyspec.eval import speedup
from dyspec.policies import POLICIES
from dyspec.views import race, share, state
from dyspec.views.state import FEATURED, Live, ViewModel, featured_step


@pytest.fixture(scope="module")
def vm(pair):
    return ViewModel(pair)


@pytest.fixture(scope="module")
def finished(vm):
    """A short greedy dyspec run with ar measured beside it."""
    *_, live = vm.run("List five fruits, one per line.", "dyspec", 6, max_new_tokens=24)
    return live


def test_download_loads_back_as_the_same_run(vm, finished, tmp_path):
    page = vm.download(finished, "h100")
    assert page.count("plotly.js v") == 1 and "<script src=" not in page  # plotly.js inlined once: offline
    assert page.count("Plotly.newPlot") == 3  # the featured tree, the per-step chart, acceptance by depth
    assert page.count(share.RECORD_ID) == 1
    # read elsewhere: the page names its machine, and has no Step slider to point to
    assert "move Step" not in page and "on this machine" not in page and "on the machine it ran on" in page
    assert "move Step" in vm.stats(finished)
    assert f"Done ({state.STOP_REASONS[finished.finished.stop_reason]})" in vm.stats(finished)  # in words
    loaded = vm.load(page.encode())
    assert loaded.steps == finished.steps and loaded.ar == finished.ar and loaded.finished == finished.finished
    assert loaded.prompt == finished.prompt and loaded.policy == "dyspec"
    assert loaded.made_on and "on the machine it ran on" in vm.stats(loaded)
    assert vm.text(loaded.steps) == vm.text(finished.steps)
    # the bare record loads too, and a loaded run downloads again to the same record
    record = share.parse_record(page)
    assert vm.load(json.dumps(record)).steps == finished.steps
    assert share.parse_record(vm.download(loaded, "h100"))["steps"] == record["steps"]


def test_a_prompt_that_closes_the_script_element_survives(vm, finished):
    live = vm.load(vm.download(finished, "h100"))
    live.prompt = "</script><script>alert(1)</script>"
    page = vm.download(live, "h100")
    assert "<script>alert(1)" not in page
    assert vm.load(page).prompt == live.prompt


@pytest.mark.parametrize(
    "mangle, message",
    [
        (lambda r: "<html>no run here</html>", "no run record"),
        (lambda r: {**r, "dyspec_run": 99}, "format 1"),
        (lambda r: {**r, "steps": "many"}, "'steps'"),
        (lambda r: {**r, "steps": [{**r["steps"][0], "evil": 1}]}, "unknown fields"),
        (lambda r: {**r, "steps": [{k: v for k, v in r["steps"][0].items() if k != "parents"}]}, "incomplete"),
        (lambda r: {**r, "steps": [{**r["steps"][0], "parents": [0]}]}, "different lengths"),
        (lambda r: {**r, "steps": [{**r["steps"][0], "tokens": ["a"] * len(r["steps"][0]["tokens"])}]}, "wrong kind"),
        (lambda r: {**r, "steps": [{**r["steps"][0], "accepted": [999]}]}, "not a tree"),
        (lambda r: {**r, "steps": []}, "no steps"),
        (lambda r: {**r, "options": ["fallback", 4]}, "'options'"),
        (lambda r: {**r, "options": {"fallback": {"nested": 1}}}, "'options'"),
    ],
)
def test_a_bad_file_gets_a_clear_error(vm, finished, mangle, message):
    record = share.parse_record(vm.download(finished, "h100"))
    bad = mangle(record)
    with pytest.raises(DyspecError, match=re.escape(message)):
        vm.load(bad if isinstance(bad, str) else json.dumps(bad))


def test_nothing_to_download_before_a_run(vm):
    from dyspec.views.state import Live

    with pytest.raises(DyspecError, match="Run a generation first"):
        vm.download(Live(), "h100")


def test_race_measures_both_then_replays_on_their_clocks(vm):
    said = []
    for run in race.run_race(vm, "Count from one to ten.", "chain", 4, 20):  # one Race, filled as it goes
        said.append(race.progress_text(run))
    assert said[0].startswith("Measuring ar (plain decoding): 0 tokens") and said[-1].startswith("Measuring chain")
    assert run.ar.finished and run.run.finished and run.run.ar == run.ar.steps
    texts = [[t for s in r.steps for t in s.emitted] for r in (run.ar, run.run)]
    assert texts[0] == texts[1]  # greedy: the same text, only its pace differs
    ends = race.clock(run.ar.steps)
    assert ends == sorted(ends) and run.seconds == max(ends[-1], race.clock(run.run.steps)[-1])
    model = vm.latency_model("h100")
    start = race.race_frame(vm, run, 0.0, model)
    assert start.count("0 tokens") == 2 and "measured" not in start  # no ratio before the finish
    middle = race.race_frame(vm, run, ends[len(ends) // 2], model)
    assert f"{len(ends) // 2 + 1} tokens" in middle  # ar: one token a step
    end = race.race_frame(vm, run, run.seconds, model)
    assert end.count("· done") == 2 and "modelled on H100" in end and "Same text as plain decoding" in end
    ratio = float(re.search(r"([\d.]+)x</span> measured", end).group(1))
    rates = [speedup.decode_rate(r.steps) for r in (run.run, run.ar)]
    assert ratio == pytest.approx(rates[0] / rates[1], abs=0.005)  # the ratio of the clocks replayed
    times = list(race.frame_times(run, 0.5))
    assert times[-1] == run.seconds and times[1] == pytest.approx(race.FRAME_S * 0.5)


def test_every_policy_says_what_it_does(vm):
    assert all(p.summary for p in POLICIES.values())
    lines = vm.policy_lines(vm.replay_policies)
    assert all(f"`{p}`" in lines for p in vm.replay_policies)


def test_a_finished_run_opens_on_its_longest_accepted_path(vm, finished):
    best = featured_step(finished.steps)
    assert len(finished.steps[best].accepted) == max(len(s.accepted) for s in finished.steps)
    assert FEATURED and featured_step([]) == 0
    assert "Same text as plain decoding, token for token" in vm.stats(finished)


def test_the_default_policy_runs_the_default_setting_and_says_so(vm):
    """The policy a page opens on runs with the default's options, which the stats name; another
    policy runs with its own defaults; options a front end gives go on top."""
    opts = dict(vm.defaults.options)
    *_, live = vm.run("Name a color you like.", vm.default_policy, 2, max_new_tokens=4, measure_ar=False)
    assert live.options == opts and live.finished.options == opts
    assert vm.load(vm.download(live, "h100")).options == opts  # a shared run says what it ran with
    assert vm.stats(live).startswith(f"<b>{vm.default_policy}</b> ({', '.join(f'{k}={v}' for k, v in opts.items())})")
    assert (
        vm.default_text
        == f"{vm.default_policy} ({', '.join(f'{k}={v}' for k, v in opts.items())}) at budget {vm.defaults.budget}"
    )
    *_, live = vm.run(
        "Name a color you like.", vm.default_policy, 2, max_new_tokens=4, measure_ar=False, options={"fallback": 1}
    )
    assert live.finished.options == {**opts, "fallback": 1}
    *_, live = vm.run("Name a color you like.", "chain", 2, max_new_tokens=4, measure_ar=False)
    assert live.options == {} and vm.stats(live).startswith("<b>chain</b> at budget 2")


def test_a_live_run_says_what_it_waits_for(vm):
    first = next(iter(vm.run("Name a color you like.", "chain", 2, max_new_tokens=4)))
    assert vm.stats(first).startswith("Measuring ar (plain decoding)")


def test_a_live_run_is_paced_for_the_screen(finished, monkeypatch):
    """Steps that come faster than a screen shows them are skipped, never the status before the
    first step nor the end; figures are due far less often than text."""
    clock = iter(range(0, 10_000, 30))  # a step every 30 ms, in ms
    monkeypatch.setattr(state.time, "perf_counter", lambda: next(clock) / 1000)
    steps = finished.steps * 20  # more steps than fit in a second at that pace
    runs = [Live(status="waiting")] + [Live(steps=steps[:k]) for k in range(1, len(steps) + 1)]
    runs.append(Live(steps=steps, finished=finished.finished))
    shown = list(state.paced(runs))
    assert shown[0] == (runs[0], False) and shown[1] == (runs[1], True) and shown[-1] == (runs[-1], True)
    gaps = [len(b.steps) - len(a.steps) for (a, _), (b, _) in zip(shown[1:-1], shown[2:-1])]
    assert gaps and set(gaps) == {state.STREAM_S * 1000 // 30 + 1}  # 4 steps of 30 ms to pass 100 ms
    drawn = [len(live.steps) for live, draw in shown[1:-1] if draw]
    assert len(drawn) > 1 and all(b - a > 30 for a, b in zip(drawn, drawn[1:]))  # a second is 34 steps


def test_replays_are_kept_and_the_sweep_says_what_it_waits_for(vm):
    prompt = "Name two animals."
    assert "Replaying" in vm.sweep_status(prompt, ["chain"], 8)
    runs = vm.replay(prompt, ["chain"], [4], 8)
    assert vm.replay(prompt, ["chain"], [4], 8)[0] is runs[0]
    vm.sweep(prompt, ["chain"], 8)
    assert vm.sweep_status(prompt, ["chain"], 8) == ""


def star_step(children: int, depth_two: int = 0) -> StepVerified:
    """A root with `children` drafted children (the first accepted, the others rejected), the first
    with a chain of `depth_two` unreached nodes below it."""
    n = 1 + children + depth_two
    parents = [-1, *[0] * children, *[1] * min(depth_two, 1), *range(children + 1, children + depth_two)]
    depths = [0, *[1] * children, *range(2, 2 + depth_two)]
    probs = [1.0, *(1 / (i + 2) for i in range(n - 1))]
    return StepVerified(
        step=0,
        tokens=list(range(n)),
        texts=[f"t{i}" for i in range(n)],
        parents=parents,
        depths=depths,
        draft_probs=probs,
        values=probs,
        target_probs=probs,
        accepted=[1],
        emitted=[1, 7],
        emitted_texts=["t1", "x"],
        next_token=7,
        draft_s=0.0,
        target_s=0.0,
        overhead_s=0.0,
        tree_build_s=0.0,
        draft_forwards=1,
    )


def test_a_run_retuned_while_it_ran_repeats_no_setting(vm):
    """Only runs of the same settings throughout are listed as repeats of each other."""
    prompt = "List five fruits, one per line."
    *_, first = vm.run(prompt, "chain", 3, max_new_tokens=24)
    knobs, checks = vm.knobs(3, 0.0), []

    def moved() -> bool:  # the stop check runs every step: the budget moves after the third
        checks.append(1)
        knobs.budget = 3 if len(checks) < 3 else 2
        return False

    *_, retuned = vm.run(prompt, "chain", 3, max_new_tokens=24, stop=moved, knobs=knobs)
    assert {s.budget for s in retuned.steps} == {2, 3} and retuned.repeats == []
    assert "repeats no earlier run" in vm.stats(retuned) and "The same settings measured" not in vm.stats(retuned)
    *_, again = vm.run(prompt, "chain", 3, max_new_tokens=24)
    assert again.repeats is first.repeats and len(again.repeats) == 2
    assert "The same settings measured 2 times" in vm.stats(again)


def test_a_loaded_run_sets_the_controls_it_ran_with(vm, finished):
    """So that the next Run runs what is on screen; what this app cannot take is left as it is."""
    loaded = vm.load(vm.download(finished, "h100", 64, 0.1))
    length = 24 if finished.finished.stop_reason == "max_new_tokens" else None
    assert vm.loaded_settings(loaded) == ("dyspec", 6, False, 0.0, 0, length)
    other = dataclasses.replace(loaded.finished, policy="not-here", budget="auto", temperature=99.0, new_tokens=10**6)
    assert vm.loaded_settings(dataclasses.replace(loaded, finished=other)) == (None, None, True, None, 0, None)


def test_a_position_past_either_end_of_the_answer_is_that_end():
    runs = [ReplayRun("chain", 4, [star_step(2), star_step(3)])]  # 2 tokens a step: 4 in the answer
    typed = (-3, 0, 2, 3, 40, "40", 2.7, "", None)
    assert [state.answer_position(runs, p) for p in typed] == [0, 0, 2, 3, 3, 3, 2, 0, 0]


def test_the_targets_own_token_hovers_as_its_own_not_as_a_drafted_node():
    fig = figures.tree_figure(star_step(3))
    (target,) = [t for t in fig.data if t.name == figures.LEGEND["target"]]
    assert "draft p" not in target.hovertemplate and "not drafted" in target.hovertemplate
    assert all("draft p" in t.hovertemplate for t in fig.data if t.mode == "markers+text" and t is not target)


def test_untried_siblings_are_never_called_rejected():
    """The verifier tries a node's children in drawing order: greedily every child is compared with
    the target's token, but when sampling the siblings drawn after the accepted one are never tried."""
    step = star_step(4, depth_two=1)  # root -> nodes 1-4 (1 accepted), node 5 under node 1, then rejected
    step.accepted, step.temperature = [1, 5], 0.0
    assert figures.node_outcomes(step) == ["root", "accepted", "rejected", "rejected", "rejected", "accepted"]
    step.temperature = 0.8
    assert figures.node_outcomes(step) == ["root", "accepted", "unreached", "unreached", "unreached", "accepted"]
    step.accepted = [2]  # the second child accepted after the first was rejected; node 5 lies under the first
    assert figures.node_outcomes(step) == ["root", "rejected", "accepted", "unreached", "unreached", "unreached"]
    step.accepted = []  # every root child tried and rejected
    assert figures.node_outcomes(step)[1:5] == ["rejected"] * 4


def labels(fig) -> list[str]:
    return [t for trace in fig.data if trace.mode == "markers+text" for t in trace.text if t]


def test_a_big_tree_labels_its_path_and_its_likeliest_rejected_nodes():
    wide = figures.tree_figure(star_step(120))  # a hundred rows: no room for every label
    shown = labels(wide)
    assert {"t0", "t1", "x"} <= set(shown) and len(shown) == 3 + figures.LABEL_REJECTED
    # the likeliest rejected siblings a label's height apart (t_k sits in row k - 1, under t1 and x)
    rows = sorted(int(t[1:]) - 1 for t in shown if t not in ("t0", "x"))
    assert rows[0] == 0 and len({b - a for a, b in zip(rows, rows[1:])}) == 1 and rows[1] > 1
    # the tallest tree (a projector's height) has rows for 20 labels besides the root's and the target's
    assert len(labels(figures.tree_figure(star_step(20)))) == 22  # rows to spare: every reached node
    assert len(labels(figures.tree_figure(star_step(30)))) < 32  # none to spare: only those that fit
    chain = figures.tree_figure(star_step(2, depth_two=254))  # a long chain opens on the depths that matter
    assert chain.layout.xaxis.range[1] < figures.ROOM_COLUMNS and "drag to see deeper" in chain.layout.xaxis.title.text
    assert len(labels(chain)) == 5  # the root, t1, x and the two rejected the verifier tried
    sizes = [s for trace in wide.data if trace.mode == "markers+text" for s in trace.marker.size]
    assert max(sizes) < 9  # a hundred rows: smaller dots, not a smear
    positions = [p for trace in chain.data if trace.mode == "markers+text" for p in trace.textposition]
    assert {"top center", "bottom center"} == set(positions)  # neighbours in a row alternate


def test_the_speedup_checks_ar_against_this_machines_profile_where_one_is_measured(vm, finished, monkeypatch, tmp_path):
    """With no profile cached, nothing is measured for the check; with one whose t(1) is far from
    ar's forwards, the stats and the what-if say the baseline ran faster than this machine runs it;
    a run made on another machine is not checked against this one's profile."""
    monkeypatch.setenv("DYSPEC_CACHE", str(tmp_path))
    assert vm.profile_ms() is None and "profile says" not in vm.stats(finished)
    ar_ms = 1e3 * sorted(s.target_s for s in finished.ar)[len(finished.ar) // 2]
    path = state.profile.profile_path(vm.pair)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"target": {"1": 10 * ar_ms}}))
    assert vm.profile_ms() == pytest.approx(10 * ar_ms)
    assert "so ar ran faster than this machine runs it" in vm.stats(finished)
    assert "so ar ran faster" in vm.whatif(finished, state.whatif.THIS_MACHINE)
    elsewhere = dataclasses.replace(finished, made_on="another host")
    assert "profile says" not in vm.stats(elsewhere)


def test_the_examples_say_what_their_record_measured():
    """Each example's "what to expect" comes from a bench of the default pair on the examples
    themselves (docs/results/cpu-examples.md): the prompts there are these, and the one said to pay
    most and the one said to pay least have the most and the fewest tokens per forward under this
    CPU's default (greedy: the pair's and the text's, not the machine's noise)."""
    from pathlib import Path

    from dyspec.views.examples import EXAMPLES

    results = Path(__file__).parent.parent / "docs" / "results"
    prompts = [json.loads(line) for line in (results / "cpu-examples-prompts.jsonl").read_text().splitlines()]
    assert [(p["id"], p["prompt"]) for p in prompts] == [(e.label, e.prompt) for e in EXAMPLES]
    records = [json.loads(line) for line in (results / "cpu-examples.jsonl").read_text().splitlines()]
    default = {r["prompt_id"]: r["tokens_per_forward"] for r in records if r["options"] and r["budget"] == 4}
    assert list(default) == [e.label for e in EXAMPLES]
    (most,) = [e.label for e in EXAMPLES if e.expect.startswith("Trees pay most")]
    (least,) = [e.label for e in EXAMPLES if e.expect.startswith("Trees pay least")]
    assert default[most] == max(default.values()) > default[least] == min(default.values())
    assert all(e.expect.startswith("Trees pay") for e in EXAMPLES)


def test_the_per_step_chart_after_knob_changes_keeps_its_axis_and_labels_apart():
    """A slider dragged changes the settings at every step: each change gets its line, a run of close
    changes one label (its last settings), and the step axis is the run's, never widened by a label."""
    steps = [star_step(2) for _ in range(60)]
    budgets = [16, 14, 12, 10, 8, *[8] * 25, 4, *[4] * 29]
    for i, (s, b) in enumerate(zip(steps, budgets)):
        s.step, s.budget, s.temperature = i, b, 0.8 if i >= 31 else 0.0
    fig = figures.steps_figure(steps)
    lines = [shape.x0 for shape in fig.layout.shapes]
    assert lines == [0.5, 1.5, 2.5, 3.5, 29.5, 30.5]
    assert [a.text for a in fig.layout.annotations] == ["budget 8, T 0", "budget 4, T 0.8"]
    assert len({a.y for a in fig.layout.annotations}) == 2  # neighbouring labels at two heights
    assert list(fig.layout.xaxis.range) == [-0.5, 59.5]
