"""The model thread (dyspec.forward.thread): a pair's generations run on one thread, whichever thread
asks (the web app's workers, the widgets' buttons, a notebook cell), with the same results."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dyspec import generate, stream
from dyspec.cli import main
from dyspec.core.events import StepVerified
from dyspec.errors import DyspecError
from dyspec.forward import thread

from .tiny import tiny_pair


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def engine_threads(pair, policy: str = "chain") -> tuple[list[int], set[int]]:
    """A generation's tokens and the threads its engine ran on (a hook runs where the engine runs)."""
    seen = set()
    result = generate(
        pair, [0, 3, 1], policy=policy, budget=4, max_new_tokens=12, hooks=[lambda e: seen.add(threading.get_ident())]
    )
    return result.token_ids, seen


def test_every_caller_thread_gets_the_same_tokens_from_the_one_model_thread(pair):
    here = engine_threads(pair)
    model_thread = thread.run(threading.get_ident)
    assert here[1] == {model_thread} and model_thread != threading.get_ident()
    out = []
    worker = threading.Thread(target=lambda: out.append(engine_threads(pair)))
    worker.start()
    worker.join()
    with ThreadPoolExecutor(2) as pool:  # as Gradio runs its events
        out += list(pool.map(lambda _: engine_threads(pair, "dyspec"), range(2)))
    assert (
        out[0] == here and out[1][0] == out[2][0] == generate(pair, [0, 3, 1], policy="ar", max_new_tokens=12).token_ids
    )
    assert all(seen == {model_thread} for _, seen in out)


def test_a_stream_stopped_early_is_closed_and_the_thread_serves_the_next(pair):
    events = stream(pair, [0, 3, 1], "chain", 4, max_new_tokens=40)
    first = next(e for e in events if isinstance(e, StepVerified))
    events.close()  # the consumer stops between events, as Stop does
    assert first.tokens and generate(pair, [0, 3, 1], policy="ar", max_new_tokens=4).new_tokens == 4


def test_errors_and_the_callers_modes_cross_the_thread(pair):
    with pytest.raises(DyspecError, match="unknown policy"):
        generate(pair, [0, 1], policy="nosuch")
    with torch.inference_mode():
        assert thread.run(torch.is_inference_mode_enabled)
    with torch.no_grad():
        assert not thread.run(torch.is_grad_enabled)
    assert thread.run(torch.is_grad_enabled) and not thread.run(torch.is_inference_mode_enabled)


def test_a_cli_command_runs_on_the_model_thread(monkeypatch):
    ran = []
    monkeypatch.setattr("dyspec.cli.decode.cmd_export", lambda args: ran.append(thread.on_it()))
    main(["export", "--format", "medusa", "--acceptance", "[0.6]", "--budget", "2"])
    assert ran == [True]
