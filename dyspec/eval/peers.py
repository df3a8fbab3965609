"""The peers outside dyspec that `dyspec bench` measures beside it on the same prompts: llama.cpp's
autoregressive decoding of the target's own GGUF file (`llamacpp`) and its prompt-lookup
speculation (`llamacpp-lookup`, `budget` tokens proposed after a match of up to 6), through
llama-cpp-python, an optional extra (`pip install -e ".[llamacpp]"`; it compiles llama.cpp).

llama.cpp runs the GGUF's quantized weights with its own kernels, so its tokens are its own: these
rows compare speed, not outputs. It runs in a child process (`LlamaCpp`): a llama.cpp built for
instructions this CPU lacks dies of SIGILL on its first forward, and that costs its rows, with a
one-line reason, not the bench."""

from __future__ import annotations

import functools
import importlib.util
import multiprocessing
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dyspec.auto.profile import median_ms
from dyspec.decode.engine import encode_prompt
from dyspec.errors import DyspecError
from dyspec.load import DEFAULT_TARGET, ModelPair, default_gguf

LLAMACPP_POLICIES = ("llamacpp", "llamacpp-lookup")
LOOKUP_AUTO = 10  # llama-cpp-python's default number of lookup tokens, for budget "auto"
MAX_NGRAM = 6  # the longest context n-gram looked up, as dyspec's `lookup`


def gguf_path(pair: ModelPair) -> Path:
    """The GGUF file the pair's target was loaded from."""
    if pair.target_name == DEFAULT_TARGET:
        return default_gguf()
    if Path(pair.target_name).suffix == ".gguf":
        return Path(pair.target_name)
    raise DyspecError(
        f"the llamacpp baselines run the target's GGUF file, and {pair.target_name} is not one: "
        "give --target FILE.gguf, or use the default target"
    )


def check_llamacpp(pair: ModelPair) -> None:
    """Fail before a bench starts where llama.cpp cannot run the pair's target."""
    gguf_path(pair)
    if importlib.util.find_spec("llama_cpp") is None:
        raise DyspecError(
            'the llamacpp baselines need llama-cpp-python: pip install -e ".[llamacpp]" (it compiles llama.cpp, '
            "a few minutes)"
        )


@functools.cache
def load_llama(path: Path, lookup_tokens: int = 0):
    """llama.cpp on as many threads as torch uses here, with prompt lookup when `lookup_tokens` > 0."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = (
        LlamaPromptLookupDecoding(max_ngram_size=MAX_NGRAM, num_pred_tokens=lookup_tokens) if lookup_tokens else None
    )
    return Llama(str(path), n_ctx=2048, n_threads=torch.get_num_threads(), draft_model=draft, verbose=False)


def llamacpp_generate(
    gguf: str, ids: list[int], lookup: int, temperature: float, seed: int, max_new_tokens: int
) -> tuple[int, float]:
    """New tokens and wall seconds (prefill included, as for every other row) of llama.cpp's
    generation from the prompt's token ids, sampling plainly at `temperature` (no top-k/top-p/min-p,
    no repetition penalty), with prompt lookup of `lookup` tokens where > 0."""
    llm = load_llama(Path(gguf), lookup)
    llm.reset()  # no prompt reuse from the previous run: each prefills its whole prompt like the others
    t = time.perf_counter()
    out = llm.create_completion(
        ids,
        max_tokens=max_new_tokens,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        repeat_penalty=1.0,
        seed=seed,
    )
    return out["usage"]["completion_tokens"], time.perf_counter() - t


class PeerCrashed(DyspecError):
    """The child process running a peer died."""


REBUILD = 'rebuild llama-cpp-python without "native" instructions (docs/guide/bench.md, "Peers: llama.cpp")'


def _serve(conn, threads: int) -> None:
    """The child's loop: run each call it is sent, (function, arguments), and send back whether it
    returned and its result or its error's text, until it is sent None."""
    torch.set_num_threads(threads)
    while (call := conn.recv()) is not None:
        function, args = call
        try:
            conn.send((True, function(*args)))
        except Exception as e:  # noqa: BLE001 (the parent raises it with its text)
            conn.send((False, f"{type(e).__name__}: {e}"))


class Child:
    """A child process (spawned, on as many threads as torch uses here) that runs `name`'s calls of
    module-level functions; one that dies raises PeerCrashed saying of what."""

    def __init__(self, name: str):
        self.name = name
        context = multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe()
        self.process = context.Process(target=_serve, args=(child_end, torch.get_num_threads()), daemon=True)
        self.process.start()
        child_end.close()

    def call(self, function: Callable, *args):
        self.conn.send((function, args))
        try:
            returned, value = self.conn.recv()
        except EOFError:
            self.process.join()
            code = self.process.exitcode
            death = f"died of {signal.Signals(-code).name}" if code and code < 0 else f"exited with {code}"
            hint = f" (an instruction this CPU lacks): {REBUILD}" if code == -signal.SIGILL else ""
            raise PeerCrashed(f"{self.name}'s process {death}{hint}") from None
        if not returned:
            raise DyspecError(value)
        return value

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(None)
        self.process.join()


class LlamaCpp:
    """The llamacpp rows of a bench, run in one child process, started at the first: the GGUF stays
    loaded between runs. After a crash every later call raises PeerCrashed at once."""

    def __init__(self, generate: Callable = llamacpp_generate):
        self.generate = generate  # a module-level function, as the child imports it
        self.child: Child | None = None
        self.crashed: PeerCrashed | None = None

    def run(
        self,
        pair: ModelPair,
        prompt: str,
        policy: str,
        budget: int | str,
        temperature: float,
        seed: int,
        max_new_tokens: int,
    ) -> tuple[int, float]:
        """New tokens and wall seconds of llama.cpp's generation from the prompt's token ids as
        dyspec encodes them (`llamacpp_generate`)."""
        if self.crashed is not None:
            raise self.crashed
        lookup = 0 if policy == "llamacpp" else LOOKUP_AUTO if budget == "auto" else int(budget)
        self.child = self.child or Child("llama.cpp")
        try:
            return self.child.call(
                self.generate,
                str(gguf_path(pair)),
                encode_prompt(pair, prompt),
                lookup,
                temperature,
                seed,
                max_new_tokens,
            )
        except PeerCrashed as e:
            self.crashed = e
            raise

    def close(self) -> None:
        if self.child is not None:
            self.child.close()


def llamacpp_forward_ms(pair: ModelPair, sizes, context: int, repeats: int = 9) -> dict[int, float]:
    """llama.cpp's t(n) on the pair's GGUF, measured as `dyspec.auto.profile.forward_ms` measures
    dyspec's: n new tokens after `context` cached ones, every row's logits returned (what verifying
    a tree needs), sizes taking turns, the median of `repeats` rounds."""
    check_llamacpp(pair)  # before the import: without llama-cpp-python, a clear error
    from llama_cpp import Llama

    vocab = pair.target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    llm = Llama(str(gguf_path(pair)), n_ctx=2048, n_threads=torch.get_num_threads(), logits_all=True, verbose=False)
    llm.eval(torch.randint(vocab, (context,), generator=g).tolist())

    def undo() -> None:
        llm.n_tokens = context  # the next eval drops the cache past it

    return median_ms(llm.eval, undo, sizes, vocab, repeats)
