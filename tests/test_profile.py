"""How `dyspec profile` times a forward (dyspec.auto.profile.median_ms)."""

import pytest

from dyspec.auto import profile
from dyspec.errors import DyspecError


def test_each_size_is_timed_right_after_a_forward_of_its_own_size(monkeypatch):
    """As decoding runs them: a forward right after one of another size costs more on the compiled
    CPU forward, which is not what a step of `ar` costs. A fake clock charges n ms for a forward of
    n after one of n, and 1000 after one of another size."""
    clock, last = [0.0], [None]

    def forward(tokens):
        n = len(tokens)
        clock[0] += (n if last[0] == n else 1000) / 1000
        last[0] = n

    monkeypatch.setattr(profile.time, "perf_counter", lambda: clock[0])
    ms = profile.median_ms(forward, lambda: None, (1, 2, 8), vocab=10, repeats=3)
    assert ms == pytest.approx({1: 1, 2: 2, 8: 8})


def test_before_runs_untimed_before_every_forward(monkeypatch):
    """`before` (a target forward, for a step's first draft forward) runs before each forward, its
    time left out: a fake clock charges it 1000 ms."""
    clock, calls = [0.0], []

    def before():
        clock[0] += 1
        calls.append("before")

    def forward(tokens):
        clock[0] += len(tokens) / 1000
        calls.append(len(tokens))

    monkeypatch.setattr(profile.time, "perf_counter", lambda: clock[0])
    ms = profile.median_ms(forward, lambda: None, (1, 2), vocab=10, repeats=3, before=before)
    assert ms == pytest.approx({1: 1, 2: 2})
    assert calls == (["before", 1] * 3 + ["before", 2] * 3) * 2  # 2 rounds of an untimed turn and 2 timed


def test_a_shaped_profile_times_steps_and_makes_a_results_section(tmp_path, capsys, monkeypatch):
    """`dyspec profile --shape`: a pair of a published shape with random weights, its t(n) and a
    step's split per policy, stamped; `dyspec report` makes a section of it."""
    import json

    from dyspec.cli import decode, main
    from dyspec.eval.report import results_page

    monkeypatch.setattr(decode, "SHAPE_STEPS", (("ar", 1), ("chain", 4)))  # fewer steps than it times
    monkeypatch.setattr(decode, "PROMPT_TOKENS", 16)

    main(["profile", "--shape", "smollm2-135m", "--device", "cpu", "--fast-path", "lean", "--sizes", "1,2", "--json"])
    profile = json.loads(capsys.readouterr().out)
    assert set(profile["target"]) == {"1", "2"} and profile["shape"] == "smollm2-135m"
    assert profile["pair"] == "shape:smollm2-135m + shape:smollm2-135m-eagle3"
    assert profile["command"].startswith("dyspec")
    assert set(profile["steps"]) == {"ar@1", "chain@4"}
    # a random draft: each of the 32 steps makes one token and drafts its whole chain, but the last,
    # where the answer's one token left is the target's own
    chain = profile["steps"]["chain@4"]
    assert chain["tokens"] == 1 and chain["draft_forwards"] == 4 * 31 / 32
    path = tmp_path / "shaped.json"
    path.write_text(json.dumps(profile))
    page = results_page([path], "Shapes")
    assert "## shaped" in page and f"Host: {profile['host']}" in page and "chain@4:" in page
    path.write_text("{}")
    with pytest.raises(DyspecError, match="not a latency profile"):
        results_page([path], "Bad")


def test_a_cached_profile_far_off_a_fresh_measurement_is_measured_again(tmp_path, monkeypatch):
    """A profile measured while something else used the machine prices every tree wrong: checked
    against a t(1) just measured, it is measured again where the two are more than PROFILE_MARGIN
    apart, either way, and kept where they agree."""
    path = tmp_path / "profile.json"
    measured = []

    def measure(pair, baseline):
        measured.append(baseline)
        return {"target": {"1": 10.0 + len(measured)}}

    monkeypatch.setattr(profile, "profile_path", lambda pair: path)
    monkeypatch.setattr(profile, "measure_profile", measure)
    assert profile.pair_profile(None)["target"]["1"] == 11.0 and measured == [False]  # measured once, then cached
    assert profile.pair_profile(None, check_ms=11.0 * profile.PROFILE_MARGIN * 0.99)["target"]["1"] == 11.0
    assert profile.pair_profile(None, check_ms=11.0 / profile.PROFILE_MARGIN * 0.99)["target"]["1"] == 12.0
    assert profile.pair_profile(None, check_ms=12.0 * profile.PROFILE_MARGIN * 1.01)["target"]["1"] == 13.0
    assert profile.pair_profile(None)["target"]["1"] == 13.0 and len(measured) == 3
