"""The notebook dashboard, driven from Python as a notebook user would drive it."""

import time

from widgets import Compare, Dashboard


def test_dashboard_run_updates_figures(pair):
    d = Dashboard(pair, prompt="List ten fruits, one per line.")
    d.policy.value, d.budget.value, d.max_new_tokens.value = "dyspec", 6, 20
    finished = d.run()
    assert finished.new_tokens == 20 and len(d.steps) == finished.target_forwards
    last = d.steps[-1]
    names = {t.name for t in d.tree_fig.data if t.name}
    assert "root" in names and "accepted" in names | {"root"}
    drawn = sum(len(t.x) for t in d.tree_fig.data if t.mode == "markers+text")
    assert drawn == len(last.tokens)  # every node of the last tree is drawn
    assert [b.y for b in d.steps_fig.data if b.type == "bar"][0] == tuple(len(s.emitted) for s in d.steps)
    assert d.ar_steps and "speedup vs ar: <b>" in d.stats.value and "prefill excluded" in d.stats.value
    assert "modelled from this run's acceptance" in d.whatif.value and "measured here" in d.whatif.value
    assert d.text.value.count("<span") == 20
    assert d.step_slider.max == len(d.steps) - 1
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


def test_compare_runs_both_on_the_same_prompt(pair):
    c = Compare(pair, "chain", "dyspec")
    c.a.prompt.value = "Say hi."
    for d in (c.a, c.b):
        d.max_new_tokens.value, d.measure_ar.value = 8, False
    a, b = c.run()
    assert a.token_ids == b.token_ids and a.policy == "chain" and b.policy == "dyspec"


def test_dashboard_examples_and_hardware_whatif(pair):
    from dyspec.views.examples import EXAMPLES

    d = Dashboard(pair)
    assert d.prompt.value == EXAMPLES[0].prompt and EXAMPLES[0].expect in d.expect.value
    d.example.value = EXAMPLES[-1]
    assert d.prompt.value == EXAMPLES[-1].prompt
    d.max_new_tokens.value, d.measure_ar.value = 8, False
    d.run()
    shipped = d.whatif.value
    assert "H100" in shipped and "ar not measured" in shipped
    d.hardware_choice.value, d.width.value, d.draft_fraction.value = "parametric", 256, 0.0
    # verification and drafts free: the speedup is the tokens per forward
    tokens_per_forward = d.finished.new_tokens / d.finished.target_forwards
    assert f"{tokens_per_forward:.2f}x on t(n) flat to 256" in d.whatif.value
