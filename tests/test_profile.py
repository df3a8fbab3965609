"""How `dyspec profile` times a forward (dyspec.auto.profile.median_ms)."""

import pytest

from dyspec.auto import profile


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
