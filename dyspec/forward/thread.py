"""One thread for the process's model work, whichever thread asks for it.

PyTorch's CPU kernels and the compiled forward run their parallel loops on OpenMP, which gives each
thread that opens a parallel region a team of worker threads of its own. Once the teams hold more
threads than there are cores, OpenMP stops spin-waiting between regions, for good and for every
team: a forward that a second thread has run, or that runs beside a second thread's, takes 2-3x
longer on a small machine (the guides' numbers). The web app (a worker thread per event), the
widgets (a thread per button press) and a notebook's cells all ask from different threads, so
dyspec does its model work (loading, generation, replay, the bench's peers, every CLI command) on
one long-lived daemon thread instead: `forward_thread` as a decorator, `run` for a single call.

A generator function's items are made on the thread one at a time, so the caller sees each event
as it comes and may stop between them (Stop, Ctrl-C); the caller's grad and inference modes go
with each call.
"""

from __future__ import annotations

import functools
import inspect
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

_jobs: queue.SimpleQueue = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start = threading.Lock()
_END = object()


def _serve() -> None:
    while True:
        future, fn, args, kwargs, grad, inference = _jobs.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller, as raised
            future.set_exception(e)
        else:
            future.set_result(result)


def on_it() -> bool:
    """Whether the calling thread is the model thread."""
    return threading.current_thread() is _thread


def run(fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on the model thread (at once where the caller is on it), its result or
    its exception returned to the caller."""
    global _thread
    if on_it():
        return fn(*args, **kwargs)
    with _start:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name="dyspec-model", daemon=True)
            _thread.start()
    future: Future = Future()
    _jobs.put((future, fn, args, kwargs, torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
    return future.result()


def threads() -> int:
    """The intra-op threads the model thread's forwards run on (a thread's own OpenMP setting)."""
    return run(torch.get_num_threads)


def set_threads(n: int) -> None:
    """Run the model thread's forwards on `n` intra-op threads."""
    run(torch.set_num_threads, n)


def items(source: Iterator) -> Iterator:
    """The items of the generator `source`, each made on the model thread; closed there too."""
    try:
        while (item := run(next, source, _END)) is not _END:
            yield item
    finally:
        try:
            run(source.close)
        except RuntimeError:  # the interpreter is shutting down: nothing is left to close
            pass


def forward_thread(fn: Callable) -> Callable:
    """Decorator: `fn` runs on the model thread; a generator function's items are made there."""
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def generator(*args: Any, **kwargs: Any) -> Iterator:
            return items(fn(*args, **kwargs))

        return generator

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return run(fn, *args, **kwargs)

    return call
