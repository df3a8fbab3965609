import warnings

import pytest
import torch

from dyspec import generate, stream
from dyspec.core.events import GenerationFinished, StepVerified, TreeExpanded
from dyspec.core.kv import KVSession
from dyspec.core.sampling import to_probs
from dyspec.core.tree import Tree
from dyspec.decode.engine import _target_probs, encode_prompt, plan, prefill, start
from dyspec.decode.step import Step, speculative_step
from dyspec.forward.lean import LeanForward
from dyspec.forward.static import StaticForward
from dyspec.load import load_pair
from dyspec.policies import POLICIES

from .conftest import PROMPTS


@pytest.fixture(scope="module")
def ar_outputs(pair):
    return [generate(pair, p, policy="ar", max_new_tokens=48).token_ids for p in PROMPTS]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is the GPU")
def test_default_pair_on_cpu(default_pair):
    """The fastest exact configuration: the int8 target and the feature draft shipped for it, and the
    device's default policy, budget and options when none is given (dyspec.defaults), a tree of
    two where the int8 kernel runs its avx2 path; a policy named alone runs with its own defaults."""
    from dyspec.kernels import int8_mm as kernel

    assert default_pair.precision == "int8" and default_pair.draft_name == "distilled"
    r = generate(default_pair, PROMPTS[0], max_new_tokens=4)
    budget = 2 if default_pair.int8_kernel == "avx2" else 4
    assert (r.policy, r.budget, r.options) == ("lookup", budget, {"fallback": 4, "confidence": 0.5})
    try:  # the avx2 path forced, as on a laptop without VNNI
        if kernel.use_path("avx2") == "avx2":
            assert generate(default_pair, PROMPTS[0], max_new_tokens=4).budget == 2
    finally:
        kernel.use_path(kernel.PATHS[0])
    assert generate(default_pair, PROMPTS[0], max_new_tokens=4, options={"fallback": 2}).options == {
        "fallback": 2,
        "confidence": 0.5,
    }
    assert generate(default_pair, PROMPTS[0], policy="lookup", max_new_tokens=4).options == {}


def test_ar_matches_hf_generate(pair, ar_outputs):
    for prompt, ours in zip(PROMPTS, ar_outputs):
        ids = encode_prompt(pair, prompt)
        out = pair.target.generate(torch.tensor([ids], device=pair.device), do_sample=False, max_new_tokens=48)
        hf = out[0, len(ids) :].tolist()
        assert ours == hf[: len(ours)] and (len(ours) == 48 or ours[-1] in pair.stop_ids)


GREEDY_CASES = [
    ("chain", 1, {}),  # the smallest tree; longer chains: the int8 and tiny-model tests
    ("specinfer", 10, {"expansion": "2,2,1"}),
    ("sequoia", 16, {"acceptance": [0.3, 0.1, 0.05, 0.03]}),
    ("sequoia", 16, {"acceptance": [0.3, 0.1, 0.05, 0.03], "step": "device"}),
    ("dyspec", 16, {}),
    ("dyspec", 16, {"step": "device"}),  # the tree grown on the device, one host read a step
    ("dyspec", 8, {"select": "sample"}),
    ("dyspec", 16, {"score": "head"}),  # SpecDec++'s head shipped for the default pair scores the tree
    ("dyspec-threshold", 16, {}),
    ("eagle2", 16, {}),
    ("sglang", 15, {"topk": 4, "steps": 3}),
    ("sglang", 15, {"topk": 4, "steps": 3, "step": "device"}),
    ("specdecpp", 8, {}),  # the head shipped for the default pair; other options: test_exact_tiny
    ("lookup", 8, {"min_ngram": 1, "fallback": 1}),
    ("suffix", 16, {}),
    ("recycling", 16, {}),
]


@pytest.mark.parametrize("policy,budget,options", GREEDY_CASES, ids=lambda x: str(x))
def test_greedy_is_token_identical_to_ar(pair, ar_outputs, policy, budget, options):
    for prompt, expected in zip(PROMPTS, ar_outputs):
        r = generate(pair, prompt, policy=policy, budget=budget, max_new_tokens=48, options=options)
        assert r.token_ids == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bf16_parts_from_ar_only_at_near_ties():
    """bf16 rounds a tree forward differently from a one-token forward, so a greedy policy may part
    from autoregressive decoding where the target's top two logits (nearly) tie: bf16 logits near 20
    are 0.125 apart, and ties are common. A logic error would part anywhere; measured partings were
    at gaps of 0.375 at most (README, "On a GPU")."""
    bf16 = load_pair(precision="native")
    assert bf16.dtype == torch.bfloat16
    for prompt in PROMPTS:
        ar = generate(bf16, prompt, policy="ar", max_new_tokens=48).token_ids
        ids = encode_prompt(bf16, prompt)
        with torch.inference_mode():
            logits = bf16.target(torch.tensor([ids + ar], device=bf16.device)).logits[0, len(ids) - 1 : -1]
        top2 = logits.float().topk(2).values
        gap = (top2[:, 0] - top2[:, 1]).tolist()
        for policy, budget, options in GREEDY_CASES:
            got = generate(bf16, prompt, policy=policy, budget=budget, max_new_tokens=48, options=options).token_ids
            parted = next((i for i, (a, b) in enumerate(zip(ar, got)) if a != b), None)
            assert parted is None or gap[parted] <= 0.5, (policy, parted, gap[parted])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the int8 draft runs on a CPU only")
def test_merged_drafts_greedy_is_token_identical_to_ar(ar_outputs):
    """specinfer over the int8 draft and the shipped distilled (feature) draft in one tree, built on the
    host and on the device (`step=device`): the same trees, step for step."""
    merged = load_pair(draft="int8,distilled")
    assert merged.drafts_label == "int8,distilled" and len(merged.extra_drafts) == 1
    for prompt, expected in zip(PROMPTS[:2], ar_outputs):  # specinfer alone has the 5-prompt case
        trees = []
        for step in ("host", "device") if prompt == PROMPTS[0] else ("host",):  # the device's step: one prompt
            steps = []
            options = {"step": step}
            r = generate(
                merged, prompt, policy="specinfer", budget=12, max_new_tokens=48, options=options, hooks=[steps.append]
            )
            assert r.token_ids == expected
            verified = [s for s in steps if isinstance(s, StepVerified)]
            assert all(len(s.tokens) <= 13 for s in verified)
            trees.append([(s.tokens, s.parents, s.accepted) for s in verified])
        assert all(tree == trees[0] for tree in trees)


def test_every_policy_has_a_greedy_case():
    assert {case[0] for case in GREEDY_CASES} == set(POLICIES) - {"ar"}


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_self_draft_accepts_everything(self_pair, temperature):
    """With the target as its own draft, a chain of 4 commits 5 tokens per target forward; the
    answer's last token, one past a multiple of 5, is the target's own: its step drafts nothing."""
    r = generate(self_pair, PROMPTS[0], policy="chain", budget=4, max_new_tokens=50, temperature=temperature)
    assert r.stop_reason == "max_new_tokens"
    assert r.tokens_per_forward == 5.0
    steps = []
    generate(
        self_pair,
        PROMPTS[0],
        policy="chain",
        budget=4,
        max_new_tokens=51,
        temperature=temperature,
        hooks=[steps.append],
    )
    steps = [e for e in steps if isinstance(e, StepVerified)]
    assert [(len(e.tokens), e.draft_forwards, len(e.emitted)) for e in steps] == [(5, 4, 5)] * 10 + [(1, 0, 1)]


def session(model, cache: str, keep_hidden: bool = False, role: str = "test") -> KVSession:
    """A session over a growing cache, or over a static or lean one (dyspec.forward.lean) whose every
    slot holds garbage at first, which must never reach a token (stale slots are masked, not cleared);
    a lean one's masks additive or boolean."""
    if cache == "dynamic":
        return KVSession(model, keep_hidden)
    if cache.startswith("lean"):  # "lean-bool": with the boolean masks its engine sessions get
        run = LeanForward(model)
        kv = KVSession(run, keep_hidden, cache=run.cache_for(role), bool_mask=cache == "lean-bool")
    else:
        kv = KVSession(model, keep_hidden, static=StaticForward(model, compiled=False).static_model(role, 512))
    with torch.inference_mode():
        for layer in kv.cache.layers:
            layer.keys.normal_(0, 1e3)
            layer.values.normal_(0, 1e3)
    return kv


@pytest.mark.parametrize("cache", ["dynamic", "static", "lean", "lean-bool"])
@pytest.mark.parametrize("pad_to", [0, 28])
def test_tree_attention_matches_root_path_forwards(pair, pad_to, cache):
    """Each node's logits are its root path's, with or without padding (`--budget auto` pads a
    forward to a size that its profile says costs less; the static path to a bucket)."""
    g = torch.Generator().manual_seed(0)
    prefix = encode_prompt(pair, PROMPTS[1])
    tree = Tree.root(prefix[-1])
    for _ in range(24):
        tree.add(int(torch.randint(len(tree), (), generator=g)), int(torch.randint(49152, (), generator=g)), 1.0)
    kv = session(pair.target, cache)
    kv.append(prefix[:-1])
    logits = kv.forward(tree.tokens, [kv.length + d for d in tree.depths], tree.ancestor_mask(), pad_to=pad_to)
    size = 32 if cache == "static" else max(pad_to, len(tree))
    assert logits.shape[0] == len(tree) and kv.cached == kv.length + size
    with torch.inference_mode():
        for node in range(len(tree)):
            ids = prefix + [tree.tokens[i] for i in tree.path(node)]
            plain = pair.target(torch.tensor([ids], device=pair.device)).logits[0, -1].float()
            torch.testing.assert_close(logits[node], plain, atol=1e-4, rtol=0)


@pytest.mark.parametrize("cache", ["dynamic", "static", "lean", "lean-bool"])
@pytest.mark.parametrize("pad_to", [0, 7])
def test_commit_keeps_accepted_path(pair, pad_to, cache):
    """After committing a non-contiguous path, the cache continues exactly like a plain forward, and
    drops a padded forward's padding; a static cache is moved in place."""
    prefix = encode_prompt(pair, PROMPTS[2])
    tree = Tree.root(prefix[-1])
    a = tree.add(0, 504, 1.0)
    tree.add(0, 1000, 1.0)
    c = tree.add(a, 6147, 1.0)
    kv = session(pair.target, cache, keep_hidden=True)
    kv.append(prefix[:-1])
    kv.forward(tree.tokens, [kv.length + d for d in tree.depths], tree.ancestor_mask(), pad_to=pad_to)
    assert kv.hidden.shape[0] == len(tree)  # what a feature draft reads: the tree's rows alone
    buffers = [layer.keys.data_ptr() for layer in kv.cache.layers]
    kv.commit([kv.length + i for i in (0, a, c)])
    assert kv.cached == kv.length == len(prefix) + 2
    assert cache == "dynamic" or buffers == [layer.keys.data_ptr() for layer in kv.cache.layers]
    nxt = kv.forward([282])[-1]
    with torch.inference_mode():
        plain = pair.target(torch.tensor([prefix + [504, 6147, 282]], device=pair.device)).logits[0, -1].float()
    torch.testing.assert_close(nxt, plain, atol=1e-4, rtol=0)


def test_events_and_hooks(pair):
    seen = []

    def broken_hook(event):
        raise RuntimeError("a view crashed")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        events = list(
            stream(pair, PROMPTS[0], policy="chain", budget=3, max_new_tokens=12, hooks=[seen.append, broken_hook])
        )
    assert events == seen
    assert any("a view crashed" in str(w.message) for w in caught)
    steps = [e for e in events if isinstance(e, StepVerified)]
    finished = events[-1]
    assert isinstance(finished, GenerationFinished) and finished.target_forwards == len(steps)
    assert sum(len(e.emitted) for e in steps) == finished.new_tokens == 12
    assert [t for e in steps for t in e.emitted] == finished.token_ids
    expansions = [e for e in events if isinstance(e, TreeExpanded) and e.step == 0]
    assert [n for e in expansions for n in e.node_ids] == list(range(1, 4))
    for e in steps:
        assert min(e.draft_s, e.target_s, e.overhead_s, e.tree_build_s) >= 0
        assert len(e.target_probs) == len(e.tokens) and all(0 <= x <= 1 for x in e.target_probs)


@pytest.mark.parametrize(
    "policy,options,reads",
    [("chain", {}, True), ("lookup", {}, True), ("lookup", {"fallback": 0}, False), ("ar", {}, False)],
)
def test_a_drafting_policy_has_the_draft_read_the_prompt_at_prefill(default_pair, policy, options, reads):
    """Where a policy drafts, the draft reads the prompt but its last token (the first root) at
    prefill, as the target does, and the first step's draft forward reads the root alone; a policy
    that never drafts (`ar`, `lookup` without its fallback) leaves the draft idle: it keeps the
    committed tokens, and gathers no features step after step."""
    pair = default_pair
    ids = encode_prompt(pair, PROMPTS[0])
    spec, options, ready = plan(pair, ids, policy, 4, 0.0, 8, options, None)
    run = start(pair, ids, spec, options, 0.0, 0, 4, 8)
    prefill(run, ids)
    draft = run.drafts[0]
    assert (draft.kv.length, draft.pending) == ((len(ids) - 1, ids[-1:]) if reads else (0, ids))
    assert draft.forwards == 0  # the prompt's forward is not a decoding one
    if reads:
        rows = draft.kv.cached
        draft.logits(Tree.root(ids[-1]), [0])
        assert draft.kv.cached == rows + 1
        return
    features = draft.pending_features
    for _ in range(3):
        speculative_step(run, draft.context[-1], ready, 8)
    assert len(draft.context) >= len(ids) + 3 and draft.pending_features is features


def test_stop_ends_cleanly(pair):
    calls = []
    r = generate(pair, PROMPTS[0], policy="ar", max_new_tokens=40, stop=lambda: calls.append(1) or len(calls) > 3)
    assert r.stop_reason == "stopped" and r.new_tokens == 3


def test_seeded_sampling_is_reproducible(pair):
    a = generate(pair, PROMPTS[3], policy="chain", temperature=0.9, seed=5, max_new_tokens=16)
    b = generate(pair, PROMPTS[3], policy="chain", temperature=0.9, seed=5, max_new_tokens=16)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_steps_target_probs_are_each_tokens_probability_after_its_parent(temperature):
    """The views' target probabilities (`_target_probs`): at T = 0 the softmax at T = 1 of the parent's
    row, at T > 0 the verifier's p, read at each node's token."""
    tree = Tree.root(5)
    for parent, token in ((0, 7), (0, 3), (1, 11)):
        tree.add(parent, token, 0.5)
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    p = to_probs(logits, temperature) if temperature else None
    step = Step(tree, [1], 2, logits, p, 0.0, 0.0, 0.0, 1, log_z=torch.logsumexp(logits, -1))
    want = (p if temperature else torch.softmax(logits, -1))[[0, 0, 1], [7, 3, 11]].tolist()
    assert _target_probs(step)[0] == 1.0
    assert _target_probs(step)[1:] == pytest.approx(want, rel=1e-5)
