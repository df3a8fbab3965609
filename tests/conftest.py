import dataclasses
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
# the cores shared among pytest-xdist's workers (`make test`): threads that outnumber the cores spin
# against each other, 4x slower on the tiny models. The environment carries the count to the
# processes tests start (notebook kernels, the app, the CLI).
THREADS = max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)))
os.environ["OMP_NUM_THREADS"] = str(THREADS)
torch.set_num_threads(THREADS)
# Triton kernels run on the CPU in Triton's interpreter (tests/test_invariant_kernels.py), which is
# chosen as each kernel is defined: set before anything imports Triton
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dyspec.forward import lean_graph  # noqa: E402 (after the environment: it imports transformers)

# the compiled forward calls its graphs without dynamo's guards; the suite checks they hold
lean_graph.CHECK_GUARDS = True

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three tips for staying focused while studying.",
    "What is the capital of France, and why is it famous?",
    "Write a Python function that reverses a string.",
]


@pytest.fixture(scope="session")
def pair():
    """The default target and draft in fp32 (`--precision fp32`): the GGUF's weights as they are, whose
    greedy outputs are token-identical to Hugging Face's `generate` and whose tree forwards match
    full forwards to fp32 rounding (on a GPU too; bf16 parts at near-ties: test_engine's bf16 test).
    The int8 default's own exactness: `default_pair` and tests/test_fastpath.py."""
    from dyspec.load import load_pair

    return load_pair(precision="fp32")


@pytest.fixture(scope="session")
def default_pair():
    """What `load_pair()` gives without arguments: on a CPU the int8 target and the shipped feature draft."""
    from dyspec.load import load_pair

    return load_pair()


@pytest.fixture(scope="session")
def self_pair(pair):
    """The target as its own draft: every drafted token is accepted at T = 0."""
    return dataclasses.replace(pair, draft=pair.target, draft_name="self")
