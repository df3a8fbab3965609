"""The notebook dashboard, driven from Python as a notebook user would drive it."""

import time

from dyspec.figures import LEGEND
from widgets import Dashboard, Race, SideBySide


def test_dashboard_run_updates_figures(pair):
    d = Dashboard(pair, prompt="List ten fruits, one per line.")
    d.policy.value, d.budget.value, d.max_new_tokens.value = "dyspec", 6, 20
    finished = d.run()
    assert finished.new_tokens == 20 and len(d.steps) == finished.target_forwards
    last = d.steps[-1]
    names = {t.name for t in d.tree_fig.data if t.name}
    assert LEGEND["root"] in names and LEGEND["accepted"] in names
    drawn = sum(len(t.x) for t in d.tree_fig.data if t.mode == "markers+text")
    own = len(last.emitted) > len(last.accepted)  # the target's token, unless the answer ended before it
    assert drawn == len(last.tokens) + own  # every node of the last tree, and the target's own token after it
    d.step_slider.value = 0
    assert LEGEND["target"] in {t.name for t in d.tree_fig.data if t.name}
    assert [b.y for b in d.steps_fig.data if b.type == "bar"][0] == tuple(len(s.emitted) for s in d.steps)
    assert d.live.ar and "Measured speedup vs ar" in d.stats.value and "prefill excluded" in d.stats.value
    assert "Run it again" in d.stats.value and len(d.live.repeats) == 1
    assert "Measured on this machine" in d.whatif.value and "Modelled on" in d.whatif.value
    assert d.text.value.count("<span") == 20
    assert d.step_slider.max == len(d.steps) - 1
    depths = d.depth_fig.data[0]  # acceptance by depth, one bar a depth the verifier reached
    reached = [len(s.accepted) + ([0, *s.accepted][-1] in s.parents[1:]) for s in d.steps]
    assert len(depths.x) == max(reached)
    d.step_slider.value = 1  # the step's tokens outlined in the text
    assert d.text.value.count("outline") == len(d.steps[1].emitted)
    first = d.live.repeats[0]
    d.run()  # the same settings again: both measurements, and their spread
    assert d.live.repeats[0] == first and len(d.live.repeats) == 2
    assert "measured 2 times here" in d.stats.value and f"{first:.2f}x" in d.stats.value
    d.export_format.value = "sglang"  # the run's tree shape for a serving engine
    assert "--speculative-eagle-topk" in d.export() and d.export_text.value == d.export()
    d.export_format.value = "vllm"
    assert "speculative_token_tree" in d.export()


def test_dashboard_step_and_growth_replay(pair):
    d = Dashboard(pair, prompt="Count to five.")
    d.max_new_tokens.value, d.measure_ar.value = 8, False
    d.policy.value, d.budget.value = "dyspec", 8  # trees of several nodes to replay
    d.run()
    d.step_slider.value = 0
    first = d.steps[0]
    d.growth_slider.value = 2
    drawn = sum(len(t.x) for t in d.tree_fig.data if t.mode == "markers+text")
    assert drawn == 2 and d.tree_fig.layout.title.text.startswith(f"step {first.step}")
    # The play button drives the same replay: each tick of its value shows one more node.
    assert d.growth_play.max == len(first.tokens)
    d.growth_play.value = 3
    drawn = sum(len(t.x) for t in d.tree_fig.data if t.mode == "markers+text")
    assert d.growth_slider.value == 3 and drawn == 3


def test_dashboard_stop_interrupts(pair):
    d = Dashboard(pair, prompt="Write a long story about a dragon.")
    d.max_new_tokens.value, d.measure_ar.value, d.policy.value = 256, False, "ar"
    d.start()
    while not d.steps:
        time.sleep(0.05)
    d.stop()
    d._thread.join(60)
    assert d.finished.stop_reason == "stopped" and d.finished.new_tokens < 256


def test_side_by_side_replays_trees_on_one_answer(pair):
    """The chosen policies replayed on one answer: a tree each at the same answer token, the
    baseline row first, a sweep line per policy; a mistake leaves the last results as they were."""
    s = SideBySide(pair, ["chain", "dyspec"], budget=8)
    s.prompt.value, s.max_new_tokens.value = "List four colors.", 16
    runs = s.run()
    assert [r.policy for r in runs] == ["chain", "dyspec"] and all(r.budget == 8 for r in runs)
    assert runs[0].tokens == runs[1].tokens == s.position.max + 1
    assert [f.layout.title.text for f in s.trees] == ["chain at 8: step 0", "dyspec at 8: step 0"]
    assert s.answer.value.count("outline") == 1
    assert "ar (baseline)" in s.table.value and "modelled on H100" in s.table.value
    assert {t.name for t in s.sweep_fig.data} == {"chain", "dyspec"}
    s.position.value = s.position.max  # the last answer token: every tree is each run's last
    last = [f"{r.policy} at 8: step {r.steps[-1].step}" for r in runs]
    assert [f.layout.title.text for f in s.trees] == last and s.answer.value.count("outline") == 1
    s.policies.value = ()
    assert s.run() == runs and "Pick at least one policy" in s.error.value and len(s.trees) == 2


def test_dashboard_bad_input_keeps_the_last_run(pair):
    d = Dashboard(pair, prompt="Say hi.")
    d.max_new_tokens.value, d.measure_ar.value = 8, False
    first = d.run()
    d.prompt.value = "  "
    assert d.run() is None and "Type a prompt first" in d.error.value
    assert d.finished is first and d.steps


def test_dashboard_examples_and_hardware_whatif(pair):
    from dyspec.views.examples import EXAMPLES

    d = Dashboard(pair)
    assert d.prompt.value == EXAMPLES[0].prompt and EXAMPLES[0].expect in d.expect.value
    d.example.value = EXAMPLES[-1]
    assert d.prompt.value == EXAMPLES[-1].prompt
    d.max_new_tokens.value, d.measure_ar.value = 8, False
    d.run()
    shipped = d.whatif.value
    assert "H100" in shipped and "measuring ar on the same prompt was off" in shipped
    d.policy.value = "ar"
    d.run()
    assert "1.00x: this run is ar" in d.whatif.value
    assert ("H100, 8B target", "h100-8b") in d.pricing.choice.options  # a menu says what it prices on
    assert d.pricing.width.layout.display == "none"  # the parametric sliders only for the parametric one
    d.pricing.choice.value, d.pricing.width.value, d.pricing.draft_fraction.value = "parametric", 256, 0.0
    assert d.pricing.width.layout.display is None
    # verification and drafts free: the speedup is the tokens per forward
    tokens_per_forward = d.finished.new_tokens / d.finished.target_forwards
    assert f"Modelled on t(n) flat to 256, draft 0% of t(1): <b>{tokens_per_forward:.2f}x</b>" in d.whatif.value


def test_dashboard_budget_and_temperature_act_on_a_running_generation(pair):
    d = Dashboard(pair, prompt="Write a long story about a dragon.")
    d.max_new_tokens.value, d.measure_ar.value, d.policy.value, d.budget.value = 256, False, "dyspec", 8
    d.start()
    while len(d.steps) < 2:
        time.sleep(0.05)
    d.budget.value, d.temperature.value = 2, 0.5
    while not d.steps or d.steps[-1].budget != 2:
        time.sleep(0.05)
    d.stop()
    d._thread.join(60)
    changed = next(s for s in d.steps if s.budget == 2)
    assert {(s.budget, s.temperature) for s in d.steps[changed.step :]} == {(2, 0.5)}
    assert all(len(s.tokens) - 1 <= 2 for s in d.steps[changed.step :])
    assert all(s.budget == 8 and s.temperature == 0 for s in d.steps[: changed.step])
    assert f"changed while it ran, from step {changed.step}: budget 2, temperature 0.5" in d.stats.value
    d._refresh()
    assert any(a.text == "budget 2, T 0.5" for a in d.steps_fig.layout.annotations)
    d.budget.value = 500  # past the limit, after the run: nothing to tune, no error
    assert d.error.value == ""


def test_dashboard_auto_says_what_it_chose(pair):
    d = Dashboard(pair, prompt="List ten fruits, one per line.")
    d.max_new_tokens.value, d.measure_ar.value, d.policy.value = 16, False, "dyspec"
    d.auto.value = True
    assert d.budget.disabled  # auto sizes the trees
    d.run()
    sizes = [len(s.tokens) - 1 for s in d.steps]
    assert f"auto drafted {sum(sizes) / len(sizes):.1f} tokens a step, {min(sizes)} to {max(sizes)}" in d.stats.value
    d.auto.value = False
    assert not d.budget.disabled


def test_dashboard_downloads_a_run_and_loads_it_back(pair, tmp_path):
    d = Dashboard(pair, prompt="Name three rivers.")
    d.policy.value, d.budget.value, d.max_new_tokens.value = "dyspec", 4, 16
    d.run()
    best = max(len(s.accepted) for s in d.steps)
    assert len(d.steps[d.step_slider.value].accepted) == best  # a finished run opens on its longest path
    assert "accepted the most" in d.stats.value and "outline" in d.text.value
    page = d.download(tmp_path / "run.html")
    e = Dashboard(pair)
    e.load(page)
    assert e.steps == d.steps and e.prompt.value == "Name three rivers." and e.text.value == d.text.value
    assert "on the machine it ran on" in e.stats.value and "Measured on the machine it ran on" in e.whatif.value
    assert e.tree_fig.layout.title.text == d.tree_fig.layout.title.text
    assert "DySpec" in d.policy_help.value and "TensorRT-LLM" in d.export_help.value


def test_race_widget_measures_and_replays(pair):
    r = Race(pair, prompt="Count from one to eight.")  # a 5-token answer: too few for a speedup
    r.policy.value, r.budget.value, r.max_new_tokens.value = "chain", 4, 12
    r.run(animate=False)
    assert "too few for a speedup" in r.board.value and "measured on this machine" not in r.board.value
    r.prompt.value, r.max_new_tokens.value = "List the days of the week.", 24
    raced = r.run(animate=False)
    assert raced.ar.finished and raced.run.finished and r.error.value == ""
    assert r.board.value.count("· done") == 2 and "measured on this machine" in r.board.value
    r.prompt.value = ""
    assert r.run(animate=False) is None and "Type a prompt" in r.error.value  # a mistake: said, the race kept
    assert r.raced is raced
