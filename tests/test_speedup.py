"""The live speedup (measured) and the hardware what-if (modelled), and the default configuration
on a CPU: ratios from one run, never a wall-clock time."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from dyspec import generate
from dyspec.auto.whatif import (
    PROFILES,
    THIS_MACHINE,
    from_profile,
    interpolate,
    load_profile,
    modelled_speedup,
    parametric,
    step_shapes,
)
from dyspec.core.events import StepVerified
from dyspec.defaults import defaults_for
from dyspec.errors import DyspecError
from dyspec.eval.speedup import (
    MIN_TOKENS,
    ar_steps,
    busy_text,
    measured_speedup,
    running_speedup,
    speedup_text,
    step_split_text,
    steps_of,
)

from .conftest import PROMPTS


def fake_step(emitted: int, size: int, draft_forwards: int, seconds: float) -> StepVerified:
    n = size
    return StepVerified(
        step=0,
        tokens=list(range(n)),
        texts=[""] * n,
        parents=[-1, *range(n - 1)],
        depths=list(range(n)),
        draft_probs=[1.0] * n,
        values=[1.0] * n,
        target_probs=[1.0] * n,
        accepted=list(range(1, emitted)),
        emitted=list(range(emitted)),
        emitted_texts=[""] * emitted,
        next_token=0,
        draft_s=0.0,
        target_s=seconds,
        overhead_s=0.0,
        tree_build_s=0.0,
        draft_forwards=draft_forwards,
    )


def test_whatif_prices_a_hand_computed_example_exactly():
    """Two steps: a tree of 4 nodes and its root (n = 5) built in 2 draft forwards of 2 nodes,
    committing 3 tokens; then a chain of 2 (n = 3) in 2 forwards of 1 node, committing 1.
    Profile: t(1) = 10, t(4) = 12, t(8) = 20 ms, so t(5) = 14 and t(3) = 11.333...; draft d(1) = 1,
    d(2) = 1.5. Cost: 14 + 2 * 1.5 + 11.333... + 2 * 1 = 30.333...; ar pays 4 tokens * 10 = 40 ms."""
    model = from_profile({"target": {"1": 10, "4": 12, "8": 20}, "draft": {"1": 1, "2": 1.5}}, "hand")
    shapes = [(5, 2, 3), (3, 2, 1)]
    assert model.target_ms(5) == 14 and model.target_ms(3) == pytest.approx(34 / 3)
    assert modelled_speedup(shapes, model) == pytest.approx(40 / (14 + 3 + 34 / 3 + 2), rel=1e-12)
    # with what a step costs besides its forwards (this machine's, measured): 1 ms a step, ar's 0.5 ms
    assert modelled_speedup(shapes, model, 1.0, 0.5) == pytest.approx(4 * 10.5 / (14 + 3 + 34 / 3 + 2 + 2), rel=1e-12)
    steps = [fake_step(3, 5, 2, 0.01), fake_step(1, 3, 2, 0.01)]
    assert step_shapes(steps) == shapes


def test_the_whatif_on_this_machine_adds_what_a_step_costs_besides_its_forwards(monkeypatch):
    """A profile prices forwards; the run measured here also built, verified and committed each step:
    the what-if for this machine says so and gives the figure with those milliseconds in."""
    from dyspec.views.state import Live, ViewModel

    from .tiny import tiny_pair

    vm = ViewModel(tiny_pair())
    model = from_profile({"target": {"1": 10, "4": 12, "8": 20}, "draft": {"1": 1, "2": 1.5}}, THIS_MACHINE)
    monkeypatch.setattr(vm, "latency_model", lambda *args: model)
    steps = [replace(fake_step(3, 5, 2, 0.014), overhead_s=0.001), replace(fake_step(1, 3, 2, 0.011), overhead_s=0.001)]
    ar = [replace(fake_step(1, 1, 0, 0.01), overhead_s=0.0005)] * 4
    text = vm.whatif(Live(steps=steps, ar=ar), THIS_MACHINE)
    shapes = step_shapes(steps)
    assert f"Modelled on this machine: <b>{modelled_speedup(shapes, model):.2f}x</b>" in text
    assert "with the 1.0 ms a step this run spent building, verifying and committing (ar: 0.5 ms)" in text
    assert f"the model gives <b>{modelled_speedup(shapes, model, 1.0, 0.5):.2f}x</b>" in text


def test_interpolate_is_flat_below_linear_between_and_extrapolated_beyond():
    t = interpolate({2: 10.0, 4: 14.0, 8: 30.0})
    assert [t(1), t(2), t(3), t(4), t(6), t(8), t(12)] == [10.0, 10.0, 12.0, 14.0, 22.0, 30.0, 46.0]


def test_parametric_accelerator_verifies_for_free_up_to_its_width():
    model = parametric(1.0, width=16, draft_fraction=0.1)
    # a 9-node tree every step, 3 draft forwards, 2.5 tokens a step: 2.5 / (1 + 0.3)
    assert modelled_speedup([(9, 3, 2)] * 2 + [(9, 3, 3)] * 2, model) == pytest.approx(2.5 / 1.3)
    assert model.target_ms(64) == 4.0
    with pytest.raises(DyspecError, match="width"):
        parametric(1.0, 0, 0.1)


def test_shipped_profiles_load_and_bad_ones_say_why(tmp_path):
    assert {"h100", "h100-8b"} <= set(PROFILES)
    assert load_profile("h100-8b").name == "H100, 8B target"
    for name in ("h100", "h100-8b"):  # on a GPU a tree of 64 costs a fraction of a forward more
        h100 = load_profile(name)
        assert h100.target_ms(1) < h100.target_ms(64) < 1.5 * h100.target_ms(1)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"device": "cpu"}))
    with pytest.raises(DyspecError, match="not a latency profile"):
        load_profile(bad)
    with pytest.raises(DyspecError, match="profile not found"):
        load_profile(tmp_path / "missing.json")


def test_measured_speedup_and_its_interval():
    ar = [fake_step(1, 1, 0, 0.02)] * 20  # 50 tokens/s
    steps = [fake_step(2, 3, 1, 0.025), fake_step(1, 3, 1, 0.025)] * 10  # 60 tokens/s
    s = measured_speedup(steps, ar)
    assert s.ratio == pytest.approx(1.2) and s.ar_tokens_per_s == pytest.approx(50)
    assert s.low < s.ratio < s.high and s == measured_speedup(steps, ar)  # seeded: the same twice
    assert measured_speedup([], ar) is None


def test_the_views_speedup_waits_then_streams_then_gives_its_interval():
    ar = [fake_step(1, 1, 0, 0.02)] * 20
    steps = [fake_step(2, 3, 1, 0.025), fake_step(1, 3, 1, 0.025)] * 10
    assert speedup_text(steps[:4], ar, final=False) == f"waiting for {MIN_TOKENS} tokens"
    assert speedup_text(steps, ar, final=False) == "1.20x"
    assert speedup_text(steps, ar, final=True) == str(measured_speedup(steps, ar)) and "interval" in str(
        measured_speedup(steps, ar)
    )


def test_a_baseline_slower_per_forward_than_the_trees_is_flagged():
    """A one-token forward never costs more than a tree's: where ar's did (by their medians, a few
    outliers aside), something else slowed ar and the speedup says so."""
    steps = [fake_step(2, 3, 1, 0.025), fake_step(1, 3, 1, 0.025)] * 10
    calm = [fake_step(1, 1, 0, 0.02)] * 18 + [fake_step(1, 1, 0, 0.5)] * 2
    assert busy_text(steps, calm) == "" and "Unreliable" not in speedup_text(steps, calm, final=True)
    slowed = [fake_step(1, 1, 0, 1.0)] * 20  # 1 token/s, as when a notebook shared the cores
    text = speedup_text(steps, slowed, final=True)
    assert text.startswith("60.00x") and "Unreliable: ar's forwards of one token took 1000.0 ms" in text
    assert "25.0 ms" in busy_text(steps, slowed) and busy_text([], slowed) == ""


def test_a_baseline_off_this_machines_profile_either_way_is_flagged():
    """ar's forwards checked against the profile's t(1): a baseline faster than this machine runs
    it (as from a faster thread) is caught too, which the comparison with the trees cannot do."""
    steps = [fake_step(2, 3, 1, 0.025), fake_step(1, 3, 1, 0.025)] * 10
    ar = [fake_step(1, 1, 0, 0.02)] * 20  # 20 ms a forward
    assert busy_text(steps, ar, profile_ms=20.0) == busy_text(steps, ar, profile_ms=29.0) == ""
    fast = busy_text(steps, ar, profile_ms=40.0)
    assert "profile says 40.0 ms, so ar ran faster" in fast and "may understate" in fast
    slow = speedup_text(steps, ar, final=False, profile_ms=10.0)
    assert slow.startswith("1.20x. Unreliable") and "ran slower" in slow and "overstates" in slow


def test_a_baseline_measured_while_the_cores_are_busy_is_flagged(default_pair):
    """The cores loaded (four spinning processes on the two cores) while ar is measured, not while
    the policy runs: the flag must catch what the interval over steps cannot."""
    kwargs = {"max_new_tokens": 24, "temperature": 0.0, "seed": 0}
    steps_of(default_pair, PROMPTS[1], "lookup", 4, **kwargs)  # warm
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    try:
        ar = ar_steps(default_pair, PROMPTS[1], 0.0, 0, 24, {"warm": {"ar", "lookup"}})
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    steps = steps_of(default_pair, PROMPTS[1], "lookup", 4, **kwargs)
    assert "Unreliable" in busy_text(steps, ar)


def test_the_views_say_where_a_step_went_beside_ars_step():
    ar = [fake_step(1, 1, 0, 0.01)] * 4
    steps = [replace(fake_step(2, 3, 2, 0.012), draft_s=0.003, overhead_s=0.001), fake_step(1, 3, 4, 0.014)]
    assert step_split_text(steps, ar) == (
        "An average step: 13.0 ms in the target's forward + 1.5 ms drafting (3.0 draft forwards) + 0.5 ms "
        "building, verifying and committing, for 1.50 tokens; ar's step: 10.0 ms for 1 token"
    )
    assert step_split_text(steps).endswith("for 1.50 tokens") and step_split_text([], ar) == ""


def test_running_speedup_waits_for_enough_tokens():
    steps = [fake_step(2, 3, 1, 0.02)] * 12
    running = running_speedup(steps, ar_tokens_per_s=50.0)
    first = MIN_TOKENS // 2 - 1  # the step whose tokens reach MIN_TOKENS
    assert running[:first] == [None] * first and running[first] == pytest.approx(2.0)


def test_ar_is_measured_once_per_prompt_and_settings(default_pair):
    pair, cache = default_pair, {}
    first = ar_steps(pair, PROMPTS[2], 0.0, 0, 8, cache)
    assert ar_steps(pair, PROMPTS[2], 0.0, 0, 8, cache) is first
    assert ar_steps(pair, PROMPTS[2], 0.0, 0, 9, cache) is not first
    assert "ar" in cache["warm"] and sum(len(s.emitted) for s in first) == 8


def default_runs(pair):
    """The default policy and `ar`, alternating over the test prompts, warm."""
    generate(pair, "Hi.", max_new_tokens=8)
    generate(pair, "Hi.", policy="ar", max_new_tokens=8)
    runs = {"ar": [], "default": []}
    for prompt in PROMPTS:
        for name, policy in (("ar", "ar"), ("default", None)):
            generate(pair, prompt, policy=policy, max_new_tokens=48, hooks=[_collect(runs[name])])
    return runs


def _collect(steps):
    return lambda e: steps.append(e) if isinstance(e, StepVerified) else None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's default configuration")
def test_default_policy_on_a_cpu_is_in_the_range_that_makes_it_faster(default_pair):
    """Faster than `ar` needs tokens per forward above what a step costs in forwards of `ar`: with
    t(3) ~ 1.1 t(1) on a CPU (int8), 1.4 tokens a forward and a draft under 20% of the step give
    1.4 * 0.8 / 1.1 = 1.02x at worst; on the int8 kernel's avx2 path, a tree of at most two drafted
    tokens, about 2.4 rows a forward at t ~ 1.15 t(1), and a draft under 15%, 1.4 * 0.85 / 1.15 =
    1.03x. Ratios from one run, not timings."""
    defaults = defaults_for(default_pair.device, default_pair.int8_kernel)
    steps = default_runs(default_pair)["default"]
    tokens_per_forward = sum(len(s.emitted) for s in steps) / len(steps)
    draft_share = sum(s.draft_s for s in steps) / sum(s.draft_s + s.target_s + s.overhead_s for s in steps)
    budget = 2 if default_pair.int8_kernel == "avx2" else 4  # dyspec.defaults
    assert (defaults.policy, defaults.budget, defaults.options) == (
        "lookup",
        budget,
        {"fallback": 4, "confidence": 0.5},
    )
    assert tokens_per_forward >= 1.4, tokens_per_forward
    assert draft_share <= (0.15 if default_pair.int8_kernel == "avx2" else 0.2), draft_share
