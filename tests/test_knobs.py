"""Settings changed while a generation runs (dyspec.decode.engine.Knobs): a change applies from the
next step, each step says what it ran with, and each is exact for its own temperature."""

import dataclasses

import pytest

from dyspec import generate, stream
from dyspec.core.events import GenerationFinished, StepVerified
from dyspec.decode.engine import Knobs

from .tiny import tiny_pair

PROMPT = [0, 3, 1, 2, 4, 1]


def run_with(pair, knobs: Knobs, change, at_step: int, policy: str = "dyspec", **kwargs):
    """A generation whose knobs `change(knobs)` after step `at_step`; its steps and its end."""
    steps = []

    def hook(event):
        if isinstance(event, StepVerified):
            steps.append(event)
            if event.step == at_step:
                change(knobs)

    *_, end = stream(pair, PROMPT, policy=policy, hooks=[hook], knobs=knobs, **kwargs)
    assert isinstance(end, GenerationFinished)
    return steps, end


def test_a_smaller_budget_applies_from_the_next_step_and_outputs_stay_greedy():
    pair = tiny_pair()
    ar = generate(pair, PROMPT, policy="ar", max_new_tokens=30).token_ids
    steps, end = run_with(pair, Knobs(8, 0.0), lambda k: setattr(k, "budget", 2), 1, max_new_tokens=30)
    assert end.token_ids == ar
    assert [s.budget for s in steps[:2]] == [8, 8] and {s.budget for s in steps[2:]} == {2}
    assert max(len(s.tokens) - 1 for s in steps[:2]) > 2 and max(len(s.tokens) - 1 for s in steps[2:]) <= 2


def test_a_larger_budget_is_cut_to_the_largest_tree_the_run_prepared_for():
    pair = tiny_pair()
    steps, _ = run_with(pair, Knobs(2, 0.0, most=4), lambda k: setattr(k, "budget", 64), 0, max_new_tokens=20)
    assert steps[0].budget == 2 and {s.budget for s in steps[1:]} == {4}
    assert max(len(s.tokens) - 1 for s in steps[1:]) == 4


@pytest.mark.parametrize("policy", ["chain", "dyspec", "specinfer"])
def test_after_a_switch_to_temperature_0_the_rest_is_the_greedy_continuation(policy):
    """Sampled steps first (T = 0.9), then greedy ones: what follows the switch is exactly what
    autoregressive decoding makes after the tokens sampled before it."""
    pair = tiny_pair()
    steps, end = run_with(
        pair, Knobs(4, 0.9), lambda k: setattr(k, "temperature", 0.0), 2, policy=policy, seed=3, max_new_tokens=24
    )
    before = sum(len(s.emitted) for s in steps[:3])
    assert [s.temperature for s in steps[:3]] == [0.9] * 3 and {s.temperature for s in steps[3:]} == {0.0}
    greedy = generate(pair, PROMPT + end.token_ids[:before], policy="ar", max_new_tokens=24 - before).token_ids
    assert end.token_ids[before:] == greedy
    sampled_only = generate(pair, PROMPT, policy=policy, budget=4, temperature=0.9, seed=3, max_new_tokens=24)
    assert sampled_only.token_ids[:before] == end.token_ids[:before]  # the same draws until the switch


def test_without_a_change_the_knobs_change_nothing():
    pair = tiny_pair()
    plain = generate(pair, PROMPT, policy="dyspec", budget=4, temperature=0.7, seed=1, max_new_tokens=20)
    tuned = generate(pair, PROMPT, policy="dyspec", seed=1, max_new_tokens=20, knobs=Knobs(4, 0.7))
    assert tuned.token_ids == plain.token_ids
    assert dataclasses.asdict(tuned)["budget"] == 4
