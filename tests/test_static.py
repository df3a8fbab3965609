"""The static-shape path (dyspec.forward.static): one preallocated cache per model and role written in
place, forwards at bucketed sizes, and compiled forwards traced whole."""

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from dyspec import generate
from dyspec.core.kv import BUCKETS, KVSession, bucket
from dyspec.errors import DyspecError
from dyspec.forward import static
from dyspec.load import load_pair

from .conftest import PROMPTS
from .test_engine import GREEDY_CASES
from .tiny import tiny_feature_pair, tiny_pair


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 17, 256, 257, 600)] == [1, 2, 4, 8, 32, 256, 257, 600]
    assert all(bucket(b) == b for b in BUCKETS)


@pytest.fixture(scope="module")
def static_pair(pair):
    return dataclasses.replace(pair, fast_path="static")


@pytest.fixture(scope="module")
def static_ar(static_pair):
    return [generate(static_pair, p, policy="ar", max_new_tokens=32).token_ids for p in PROMPTS[:2]]


@pytest.mark.parametrize("policy,budget,options", GREEDY_CASES, ids=lambda x: str(x))
def test_greedy_is_token_identical_to_ar_on_the_static_path(static_pair, static_ar, policy, budget, options):
    for prompt, expected in zip(PROMPTS[:2], static_ar):
        r = generate(static_pair, prompt, policy=policy, budget=budget, max_new_tokens=32, options=options)
        assert r.token_ids == expected


@pytest.mark.parametrize("policy", ["chain", "dyspec", "lookup"])
def test_auto_budget_on_the_static_path(policy):
    """`--budget auto` pads a forward where its profile (measured on the static path) says it pays;
    the bucket pads it further."""
    pair = dataclasses.replace(tiny_feature_pair(), fast_path="static")
    expected = generate(pair, [0, 3, 1, 2], policy="ar", max_new_tokens=40).token_ids
    assert generate(pair, [0, 3, 1, 2], policy=policy, budget="auto", max_new_tokens=40).token_ids == expected


def test_a_static_cache_is_kept_between_generations_and_grown_when_short(static_pair):
    generate(static_pair, PROMPTS[0], policy="dyspec", budget=8, max_new_tokens=8)
    forward = static_pair.forward(static_pair.target)
    held = forward.held["target"]
    generate(static_pair, PROMPTS[1], policy="dyspec", budget=8, max_new_tokens=8)
    assert forward.held["target"] is held
    grown = forward.static_model("target", held.capacity + 1)
    assert grown is not held and grown.capacity == held.capacity + static.ROUND


def test_the_int8_path_is_exact_on_the_static_path():
    int8 = load_pair(fast_path="static")
    assert (int8.precision, int8.fast_path) == ("int8", "static")
    for prompt in PROMPTS[:2]:
        expected = generate(int8, prompt, policy="ar", max_new_tokens=32).token_ids
        assert generate(int8, prompt, policy="dyspec", budget=12, max_new_tokens=32).token_ids == expected


@pytest.mark.parametrize("make", [tiny_pair, tiny_feature_pair])
def test_compiled_forwards_trace_whole_and_stay_exact(monkeypatch, make):
    """Each bucket's forward traces as one graph (fullgraph: a graph break fails), what CUDA graphs
    capture; a counting backend checks the traces here and runs them eagerly. A second generation
    compiles nothing."""
    traces = CompileCounter()
    monkeypatch.setattr(
        static, "compile_options", lambda device: {"backend": traces, "fullgraph": True, "dynamic": False}
    )
    pair = make()
    compiled = dataclasses.replace(pair, fast_path="compiled")
    prompt = [0, 3, 1, 2]
    expected = generate(pair, prompt, policy="ar", max_new_tokens=40).token_ids
    for policy in ("chain", "dyspec"):
        assert generate(compiled, prompt, policy=policy, budget=6, max_new_tokens=40).token_ids == expected
    held = compiled.forward(compiled.target).held
    graphs = {role: set(s.compiled) for role, s in held.items()}
    assert graphs["target"] == {(b, last) for b in (1, 2, 4, 8) for last in (False, True)}
    assert traces.frame_count >= len(graphs["target"]) and traces.op_count > 0
    count = traces.frame_count
    generate(compiled, prompt, policy="dyspec", budget=6, max_new_tokens=40)
    assert {role: s.compiled for role, s in held.items()} == graphs
    assert traces.frame_count == count


def test_fast_path_choices_fail_clearly(pair):
    with pytest.raises(DyspecError, match="fast path must be one of"):
        load_pair(precision="fp32", fast_path="turbo")
    kv = KVSession(pair.target, static=static.StaticForward(pair.target, compiled=False).static_model("short", 4))
    with pytest.raises(DyspecError, match="holds 1024 tokens"):
        kv.forward(list(range(1030)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_compiled_path_on_a_gpu_is_exact():
    """torch.compile's "reduce-overhead" (CUDA graphs) on the fp32 default pair."""
    compiled = load_pair(precision="fp32", fast_path="compiled")
    assert compiled.device.type == "cuda"
    expected = generate(compiled, PROMPTS[0], policy="ar", max_new_tokens=32).token_ids
    for policy in ("chain", "dyspec"):
        assert generate(compiled, PROMPTS[0], policy=policy, budget=16, max_new_tokens=32).token_ids == expected
