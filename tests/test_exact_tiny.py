"""End to end at T > 0: every policy samples the first 3 tokens exactly as the target does.

The pairs run dyspec's lean forward (dyspec.forward.lean), faster than Hugging Face's, whose own
run is `test_the_hugging_face_forward_samples_target_distribution`."""

import copy
import dataclasses
import json

import pytest
import torch
from scipy.stats import chisquare

from dyspec import figures, generate
from dyspec.auto.budget import PROBE_AFTER, AutoState, Growth
from dyspec.auto.controller import budget_controller
from dyspec.auto.estimate import COPY
from dyspec.auto.profile import (
    CONTEXT,
    DEFAULT_SIZES,
    FIRST_SIZES,
    LONG_CONTEXT,
    LONG_SIZES,
    forward_ms,
    pair_profile,
    profile_path,
    target_profiles,
)
from dyspec.core.copying import MATCHES
from dyspec.core.draft import DraftSession
from dyspec.core.events import StepVerified
from dyspec.core.kv import KVSession
from dyspec.core.tree import Tree
from dyspec.core.vocab import DraftVocab
from dyspec.errors import DyspecError
from dyspec.eval.calibrate import calibrate
from dyspec.policies import POLICIES, available_policies, get_policy

from .tiny import (
    exact_distribution,
    tiny_eagle3_pair,
    tiny_eagle_pair,
    tiny_feature_pair,
    tiny_head_file,
    tiny_medusa_pair,
    tiny_model,
    tiny_pair,
    tiny_tokenizer,
)

PROMPT = [0, 3, 1]
TEMPERATURE = 0.8
RUNS = 2000
CASES = [
    ("ar", {}),
    ("chain", {}),
    ("specinfer", {"expansion": "2,1"}),  # i.i.d. children, MSS
    ("sequoia", {"acceptance": [0.5, 0.2, 0.1]}),  # without replacement
    ("dyspec", {}),  # without replacement
    ("dyspec", {"select": "top"}),  # deterministic children
    ("dyspec-threshold", {}),
    ("eagle2", {"topk": 2, "depth": 2}),
    ("sglang", {"topk": 2, "steps": 2}),
    ("specdecpp", {"h": 0.5, "min_k": 1}),  # a random head: K varies with the hidden state
    ("dyspec", {"score": "head", "batch": 1}),  # the random head's predictions shape the tree
    ("lookup", {"min_ngram": 1, "fallback": 0}),  # copied tokens only, one-hot proposals
    ("lookup", {"min_ngram": 2, "fallback": 2}),  # a chain from the draft where nothing matches
    ("lookup", {"fallback": 4, "confidence": 0.3}),  # that chain cut where its value falls
    ("suffix", {}),  # a tree of copies, one-hot proposals
    ("recycling", {"width": 2}),  # the target's own earlier top-k, one-hot proposals
    # the step on the device: children drawn and verified as tensor ops, coins from the device's generator
    ("chain", {"step": "device"}),  # i.i.d., one child a node
    ("sequoia", {"acceptance": [0.5, 0.2, 0.1], "step": "device"}),  # without replacement
    ("dyspec", {"step": "device"}),  # without replacement
    ("dyspec", {"select": "top", "step": "device"}),  # deterministic children
    ("eagle2", {"topk": 2, "depth": 2, "step": "device"}),  # deterministic children, the pool cut
    ("dyspec-threshold", {"step": "device"}),  # without replacement, a layer a forward
    ("specinfer", {"expansion": "2,1", "step": "device"}),  # i.i.d. children, MSS
    ("specdecpp", {"h": 0.5, "min_k": 1, "step": "device"}),  # the stop as padding, the head on the device
    ("dyspec", {"score": "head", "batch": 1, "step": "device"}),  # the head's reach on the device
]
FEATURE_CASES = [("chain", {}), ("dyspec", {})]  # a feature draft that cannot propose every token


@pytest.fixture(scope="module")
def pair():
    return dataclasses.replace(tiny_pair(), fast_path="lean")


@pytest.fixture(scope="module")
def hf_pair():
    """The tiny pair on the Hugging Face forward, for what spies on the target model's own forwards."""
    return tiny_pair()


def lean_feature_pair():
    return dataclasses.replace(tiny_feature_pair(), fast_path="lean")


@pytest.fixture(scope="module")
def feature_pair():
    return lean_feature_pair()


@pytest.fixture(scope="module")
def exact(pair):
    return exact_distribution(pair.target, PROMPT, 3, TEMPERATURE)


def test_every_policy_is_covered():
    assert {case[0] for case in CASES} == set(POLICIES)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return tiny_head_file(tmp_path_factory.mktemp("head") / "head.safetensors")


@pytest.mark.parametrize("policy,options", CASES, ids=lambda x: str(x))
def test_policy_samples_target_distribution(pair, exact, head, policy, options):
    uses_head = policy == "specdecpp" or options.get("score") == "head"
    check_distribution(pair, exact, policy, {**options, "head": head} if uses_head else options)


@pytest.mark.parametrize("policy,options", FEATURE_CASES, ids=lambda x: str(x))
def test_feature_draft_samples_target_distribution(feature_pair, exact, policy, options):
    check_distribution(feature_pair, exact, policy, options)


@pytest.mark.parametrize("policy,options", FEATURE_CASES, ids=lambda x: str(x))
def test_a_copying_draft_samples_target_distribution(exact, policy, options):
    """q mixed with the copied token (dyspec.core.copying), which may be one the draft cannot propose."""
    pair = lean_feature_pair()
    pair.draft.copy_weights = [0.5] * MATCHES
    check_distribution(pair, exact, policy, options)


def test_a_wrong_vocabulary_map_fails_the_distribution_test(feature_pair, exact, monkeypatch):
    """The tests above can fail: a verifier that reads the draft's q on the wrong tokens (its columns
    shifted by one: dyspec.core.vocab), in the acceptance test and the residual, no longer samples
    the target's distribution. The draft still proposes through the right map."""
    widen, column = DraftVocab.widen, DraftVocab.column

    def shifted(vocab):
        return DraftVocab.of(vocab.ids.roll(1), vocab.size)

    monkeypatch.setattr(DraftVocab, "widen", lambda vocab, q, fill=0.0: widen(shifted(vocab), q, fill))
    monkeypatch.setattr(DraftVocab, "column", lambda vocab, token, width: column(shifted(vocab), token, width))
    assert distribution_pvalue(feature_pair, exact, "chain", {}) < 1e-4


def test_an_eagle_draft_samples_target_distribution(exact, tmp_path):
    """A published EAGLE-1/2 draft's layout (dyspec.drafts.eagle), read as a user's download is,
    under DySpec's tree (children sampled without replacement)."""
    check_distribution(tiny_eagle_pair(tmp_path), exact, "dyspec", {})


def test_an_eagle3_draft_samples_target_distribution(tmp_path):
    """EAGLE-3's own reduced vocabulary (dyspec.drafts.eagle.Eagle3Draft): q is 0 outside it."""
    pair = tiny_eagle3_pair(tmp_path)
    check_distribution(pair, exact_distribution(pair.target, PROMPT, 3, TEMPERATURE), "dyspec", {})


def test_medusa_heads_sample_target_distribution(exact, tmp_path):
    """Medusa's heads (dyspec.drafts.medusa): every node at one depth drafts from the same q."""
    check_distribution(tiny_medusa_pair(tmp_path), exact, "dyspec", {})


@pytest.mark.parametrize("step", ["host", "device"])
def test_merged_drafts_sample_target_distribution(feature_pair, exact, step):
    """specinfer over a feature draft (which cannot propose token 3) and an independent draft: at
    the root, two i.i.d. draws from each, every one verified against its own draft's q; built and
    verified on the host, and on the device."""
    pair = dataclasses.replace(feature_pair, extra_drafts=[tiny_model(2)], extra_draft_names=["tiny-draft"])
    check_distribution(pair, exact, "specinfer", {"step": step})


@pytest.mark.parametrize("policy,options", FEATURE_CASES, ids=lambda x: str(x))
def test_the_static_path_samples_target_distribution(feature_pair, exact, policy, options):
    """Bucketed forwards over a preallocated cache (dyspec.forward.static), the draft's padded too."""
    check_distribution(dataclasses.replace(feature_pair, fast_path="static"), exact, policy, options)


@pytest.mark.parametrize("policy,options", [("specinfer", {"expansion": "2,1"}), *FEATURE_CASES], ids=lambda x: str(x))
def test_the_hugging_face_forward_samples_target_distribution(exact, policy, options):
    """The Hugging Face forward (`--fast-path off`, the reference) runs the target and the draft, an
    independent one or a feature draft."""
    pair = tiny_pair() if policy == "specinfer" else tiny_feature_pair()
    check_distribution(pair, exact, policy, options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the int8 path runs on a CPU only")
@pytest.mark.parametrize(
    "policy, options", [("dyspec", {}), ("dyspec", {"step": "device"}), ("chain", {"step": "device"})]
)
def test_the_compiled_int8_forward_samples_target_distribution(policy, options):
    """The compiled int8 forward (dyspec.forward.lean_graph) as target and, through the same graphs,
    as its own draft under DySpec's tree, and under the step on the device, whose programs compile
    with it (dyspec.core.programs: the heap's rounds and their race, a chain's sampled links, the
    verification's walk). Its logits differ from the Hugging Face forward's of the same int8 model
    in the last bits only, far below what 2,000 samples resolve."""
    from dyspec.load.pair import ModelPair

    from .test_lean_graph import tiny_int8

    target, draft = tiny_int8(), tiny_int8(2)
    pair = ModelPair(
        target, draft, tiny_tokenizer(), "t", "d", torch.device("cpu"), torch.float32, "int8", fast_path="compiled"
    )
    check_distribution(pair, exact_distribution(target, PROMPT, 3, TEMPERATURE), policy, options)


def check_distribution(pair, exact, policy, options, budget=4):
    assert distribution_pvalue(pair, exact, policy, options, budget) > 1e-4


def distribution_pvalue(pair, exact, policy, options, budget=4) -> float:
    """The chi-square p-value of RUNS generations' first 3 tokens against `exact`."""
    V = pair.target.config.vocab_size
    counts = torch.zeros(V**3)
    for seed in range(RUNS):
        ids = generate(
            pair,
            PROMPT,
            policy=policy,
            budget=budget,
            temperature=TEMPERATURE,
            seed=seed,
            max_new_tokens=3,
            options=options,
        ).token_ids
        counts[ids[0] * V * V + ids[1] * V + ids[2]] += 1
    expected = exact * RUNS
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    return chisquare(obs.numpy(), exp.numpy()).pvalue


@pytest.mark.parametrize("temperature", [0.0, TEMPERATURE])
def test_every_policy_builds_a_budget_of_1(pair, head, temperature):
    """`auto` asks for trees of 1 node at an answer's end. dyspec-threshold's default t = 1/budget
    was 1 there (an error), and Sequoia's optimal tree of 1 node can be the root alone."""
    options = {"sequoia": {"acceptance": [0.0, 0.9]}, "specdecpp": {"head": head}}
    expected = generate(pair, PROMPT, policy="ar", max_new_tokens=6).token_ids
    for policy in POLICIES:
        r = generate(
            pair,
            PROMPT,
            policy=policy,
            budget=1,
            temperature=temperature,
            max_new_tokens=6,
            options=options.get(policy),
        )
        assert len(r.token_ids) == 6 and (temperature > 0 or r.token_ids == expected), policy


@pytest.mark.parametrize("temperature", [0.0, TEMPERATURE])
def test_auto_takes_trees_of_nothing(pair, steep_profile, temperature):
    """A policy may build no node at all under `auto` (`ar`; Sequoia's optimal tree can be the root
    alone): at T = 0 the first such tree raised an IndexError where `auto` priced its first node."""
    kwargs = {"temperature": temperature, "max_new_tokens": 24}
    expected = generate(pair, PROMPT, policy="ar", **kwargs).token_ids
    state = AutoState()
    assert generate(pair, PROMPT, policy="ar", budget="auto", auto_state=state, **kwargs).token_ids == expected
    assert state.growth.cap == 0  # nothing is ever built, so the cap stays 0 (its probes build nothing too)
    r = generate(pair, PROMPT, policy="sequoia", budget="auto", options={"acceptance": [0.0, 0.9]}, **kwargs)
    assert len(r.token_ids) == 24 and (temperature > 0 or r.token_ids == expected)


def save_profile(pair, tmp_path, monkeypatch, ms) -> None:
    """A saved latency profile for the tiny target, t(n) = ms(n), in a fresh cache folder."""
    monkeypatch.setenv("DYSPEC_CACHE", str(tmp_path))
    path = profile_path(pair)
    path.parent.mkdir(parents=True)
    draft = {str(n): 0.5 for n in DEFAULT_SIZES}  # the draft's forwards cost 0.5 ms, at any size
    path.write_text(json.dumps({"target": {str(n): ms(n) for n in DEFAULT_SIZES}, "draft": draft}))


def test_auto_times_the_target_behind_two_contexts_and_the_draft(pair, tmp_path, monkeypatch):
    """`auto`'s profile: every size behind CONTEXT tokens, a few behind LONG_CONTEXT, the draft's
    every size, measured once and then read from the cache."""
    monkeypatch.setenv("DYSPEC_CACHE", str(tmp_path))
    profile = pair_profile(pair)
    profiles = target_profiles(profile)
    assert [list(profiles[c]) for c in (CONTEXT, LONG_CONTEXT)] == [list(DEFAULT_SIZES), list(LONG_SIZES)]
    assert list(profile["draft"]) == [str(n) for n in DEFAULT_SIZES]
    assert list(profile["draft_first"]) == [str(n) for n in FIRST_SIZES]  # on a CPU
    assert json.loads(profile_path(pair).read_text()) == profile


@pytest.fixture
def steep_profile(pair, tmp_path, monkeypatch):
    """Every tree node costs as much as the first, so `--budget auto` keeps only some nodes,
    depending on their values."""
    save_profile(pair, tmp_path, monkeypatch, lambda n: 1.0 + n)
    assert target_profiles(pair_profile(pair)) == {CONTEXT: {n: 1.0 + n for n in DEFAULT_SIZES}}  # no slope


@pytest.fixture
def costly_profile(pair, tmp_path, monkeypatch):
    """One tree node costs 100 one-token forwards: no tree pays for itself."""
    save_profile(pair, tmp_path, monkeypatch, lambda n: 1.0 + 100 * (n - 1))


@pytest.mark.parametrize("policy", ["dyspec", "dyspec-threshold"])
@pytest.mark.parametrize("step", ["host", "device"])
def test_auto_budget_samples_target_distribution(pair, exact, steep_profile, policy, step):
    """End to end through the engine's cut (children drawn without replacement, nodes dropped with
    their later siblings) and the builds that read auto's learnt rates; on the device, the trees
    grown to auto's cap by those rates and verified whole;
    `test_auto_budget_at_t_above_0_ignores_the_drawn_token` is the sharp test."""
    check_distribution(pair, exact, policy, {"step": step}, budget="auto")


@pytest.fixture
def flat_profile(pair, tmp_path, monkeypatch):
    """A tree node costs a hundredth of a one-token forward: nodes pay unless they are unlikely."""
    save_profile(pair, tmp_path, monkeypatch, lambda n: 10.0 + 0.1 * n)


@pytest.mark.parametrize("policy,options", [("lookup", {"min_ngram": 1, "fallback": 1}), ("suffix", {})])
def test_auto_copies_sample_target_distribution(pair, exact, flat_profile, policy, options):
    """Copies cut by their values (lookup's chain, suffix's tree), and for lookup one-node draft
    chains where nothing matches."""
    check_distribution(pair, exact, policy, options, budget="auto")


def test_auto_sizes_lookups_copies_apart_from_the_drafts_cap(pair, flat_profile):
    """Copies cost no draft time: under `auto`, lookup copies past the cap learnt from draft trees
    (that cap bounds its fallback alone), copy steps leave that cap alone, and copies learn their
    own acceptance rates (`copy_bin`), not the draft's."""
    options = {"min_ngram": 1, "fallback": 0}
    state = AutoState(growth=Growth(cap=1))
    steps = []
    kwargs = {"max_new_tokens": 40, "options": options, "hooks": [steps.append], "auto_state": state}
    r = generate(pair, PROMPT, policy="lookup", budget="auto", **kwargs)
    assert r.token_ids == generate(pair, PROMPT, policy="ar", max_new_tokens=40).token_ids
    verified = [s for s in steps if isinstance(s, StepVerified)]
    assert max(len(s.tokens) - 1 for s in verified) > 1 and all(s.draft_forwards == 0 for s in verified)
    copy = next(s for s in verified if len(s.tokens) > 1)  # the views say what a copy followed
    assert "copied after a" in figures.tree_figure(copy).layout.title.text and copy.copied_after >= 1
    reached = state.acceptance.reached
    assert state.growth.cap == 1 and sum(reached[COPY:]) > 0 and sum(reached[:COPY]) == 0


@pytest.mark.parametrize("policy", ["chain", "lookup", "specinfer"])
def test_auto_drafts_nothing_for_the_answers_last_token(pair, flat_profile, policy):
    """As a fixed budget: with one token of the answer left, the target's one-row forward gives it
    (no drafted node could be kept), and that step teaches `auto` nothing."""
    pairs = {"specinfer": dataclasses.replace(pair, extra_drafts=[pair.draft], extra_draft_names=["tiny-draft"])}
    run_pair, last_steps = pairs.get(policy, pair), 0
    profile_path(run_pair).write_text(profile_path(pair).read_text())  # the flat profile, for two drafts too
    for n in range(4, 20):
        steps, state = [], AutoState()
        kwargs = {"max_new_tokens": n, "hooks": [steps.append], "auto_state": state}
        r = generate(run_pair, PROMPT, policy=policy, budget="auto", **kwargs)
        assert r.token_ids == generate(pair, PROMPT, policy="ar", max_new_tokens=n).token_ids
        verified = [s for s in steps if isinstance(s, StepVerified)]
        if sum(len(s.emitted) for s in verified[:-1]) == n - 1:  # the last step began with one token left
            last_steps += 1
            assert len(verified[-1].tokens) == 1 and verified[-1].draft_forwards == 0
        # such a step, asked of the controller again, leaves its learnt state as it was
        controller = budget_controller(run_pair, get_policy(policy), "auto", {}, 0.0, state)
        before = copy.deepcopy(state)
        plan = controller.plan(len(PROMPT) + n, 0)
        tree, old_ids, plan = controller.cut(plan, Tree.root(0), [])
        controller.learn(plan, tree, [])
        assert plan.cap is None and old_ids is None and state == before
    assert last_steps >= 2  # the test saw such steps


@pytest.fixture
def lumpy_profile(hf_pair, tmp_path, monkeypatch):
    """As `steep_profile`, but forwards of 1 to 3 tokens cost as much as 8: every step pads them to 4."""
    save_profile(hf_pair, tmp_path, monkeypatch, lambda n: 9.0 if n < 4 else 1.0 + n)


@pytest.mark.parametrize("policy", ["chain", "dyspec"])
def test_auto_pads_forwards_where_more_tokens_cost_less(hf_pair, lumpy_profile, monkeypatch, policy):
    """Under `auto` the target's forward runs at the size that `dyspec.auto.cost.padded_size` prices (here at
    least 4 tokens), and the output stays the target's."""
    calls = []
    forward = KVSession.forward

    def spy(self, tokens, positions=None, visible=None, **kwargs):
        logits = forward(self, tokens, positions, visible, **kwargs)
        if self.model is hf_pair.target and kwargs.get("pad_to"):
            calls.append((len(tokens), kwargs["pad_to"], len(logits)))
        return logits

    expected = generate(hf_pair, PROMPT, policy="ar", max_new_tokens=24).token_ids
    monkeypatch.setattr(KVSession, "forward", spy)
    assert generate(hf_pair, PROMPT, policy=policy, budget="auto", max_new_tokens=24).token_ids == expected
    assert calls and all(pad == max(n, 4) and rows == n for n, pad, rows in calls)
    assert any(n < 4 for n, _, _ in calls)


def test_auto_drafts_nothing_where_no_tree_pays(pair, costly_profile):
    """Where no node is worth its cost, `auto` takes autoregressive steps that leave the draft idle,
    and probes with one node after 16 such steps (the first tree was a short run), then 32: the
    probe's root forward reads the tokens the draft skipped too."""
    state, steps = AutoState(), []
    r = generate(pair, PROMPT, policy="chain", budget="auto", max_new_tokens=56, hooks=[steps.append], auto_state=state)
    assert r.token_ids == generate(pair, PROMPT, policy="ar", max_new_tokens=56).token_ids
    steps = [s for s in steps if isinstance(s, StepVerified)]
    assert all(len(s.tokens) == 1 for s in steps)  # every tree was cut to its root
    drafting = [i for i, s in enumerate(steps) if s.draft_forwards]
    assert drafting == [0, 17, 50]
    # a chain of 16 (the starting cap), then a probe's root, which reads the skipped tokens with it
    assert [steps[i].draft_forwards for i in drafting] == [16, 1, 1]
    assert state.growth.cap == 0 and state.growth.probe_cap == 1 and state.growth.probe_after == 64


def test_trees_sized_by_the_answers_end_leave_the_cap_and_probes_alone(pair, costly_profile):
    """No tree pays here, but every tree of this 5-token answer is cut short by its end (cap 8, at
    most 4 tokens left to draft): they say nothing of the next answer's trees, so neither the cap
    nor the probes' schedule moves (the probes' wait had doubled at each such tree)."""
    state = AutoState(growth=Growth(cap=8))
    generate(pair, PROMPT, policy="chain", budget="auto", max_new_tokens=5, auto_state=state)
    growth = state.growth
    assert (growth.cap, growth.probe_after, growth.drafted, growth.idle) == (8, PROBE_AFTER, 0, 0)


@pytest.mark.parametrize("policy", ["chain", "dyspec"])
def test_a_seeded_auto_call_repeats_exactly(pair, steep_profile, policy):
    """`auto` prices every millisecond with the profile, never the clock, and each call starts a
    fresh state: the same call twice gives the same trees and tokens at T > 0. A state passed on
    purpose carries what the first call learnt into the second."""
    steps = [[], []]
    for i in range(2):
        kwargs = {"temperature": 0.6, "seed": 3, "max_new_tokens": 24, "hooks": [steps[i].append]}
        generate(pair, PROMPT, policy=policy, budget="auto", **kwargs)
    trees = [[(e.tokens, e.parents, e.accepted) for e in run if isinstance(e, StepVerified)] for run in steps]
    assert trees[0] == trees[1] and len({len(t[0]) for t in trees[0]}) > 1  # trees of several sizes
    state = AutoState()
    generate(pair, PROMPT, policy=policy, budget="auto", temperature=0.6, auto_state=state, max_new_tokens=24)
    learnt = (list(state.acceptance.reached), state.growth.cap, state.acceptance.tokens_per_ms)
    assert sum(state.acceptance.reached) > 0 and state.acceptance.tokens_per_ms is not None
    generate(pair, PROMPT, policy=policy, budget="auto", temperature=0.6, auto_state=state, max_new_tokens=24)
    assert (list(state.acceptance.reached), state.growth.cap, state.acceptance.tokens_per_ms) != learnt


def test_auto_trees_end_with_the_answer(pair, steep_profile):
    """Under `auto` no node is deeper than the tokens left less the bonus token, and those last,
    shorter trees leave the cap as it was: they say nothing of the next answer's trees."""
    state, steps = AutoState(growth=Growth(cap=8)), []
    r = generate(pair, PROMPT, policy="chain", budget="auto", max_new_tokens=5, hooks=[steps.append], auto_state=state)
    assert r.token_ids == generate(pair, PROMPT, policy="ar", max_new_tokens=5).token_ids
    left, depths = 5, []
    for step in (s for s in steps if isinstance(s, StepVerified)):
        depths.append((max(step.depths), min(8, max(1, left - 1))))
        left -= len(step.emitted)
    # the first tree reaches the bound (its steps price nodes alike); later cuts weigh learnt rates
    assert depths[0][0] == depths[0][1] and all(depth <= bound for depth, bound in depths)
    assert state.growth.cap == 8 and sum(state.acceptance.reached) > 0
    # specinfer over two merged drafts needs a node from each, even where 1 token is left to draft
    merged = dataclasses.replace(pair, extra_drafts=[tiny_model(3)], extra_draft_names=["tiny-draft-2"])
    r = generate(merged, PROMPT, policy="specinfer", budget="auto", max_new_tokens=2)
    assert r.token_ids == generate(pair, PROMPT, policy="ar", max_new_tokens=2).token_ids


def test_a_stop_token_of_the_generation_config_ends_generation():
    """Hugging Face's generate stops at the generation config's EOS tokens (there may be several, and
    not the tokenizer's); every policy stops where it does, with the stop token kept."""
    pair = tiny_pair()
    free = generate(pair, PROMPT, policy="ar", max_new_tokens=12).token_ids
    stop = free[4]
    pair.target.generation_config.eos_token_id = [stop, 99]
    with torch.inference_mode():
        hf = pair.target.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12, pad_token_id=0)
    expected = free[: free.index(stop) + 1]
    assert hf[0, len(PROMPT) :].tolist() == expected
    for policy in ("ar", "chain", "dyspec"):
        r = generate(pair, PROMPT, policy=policy, budget=4, max_new_tokens=12)
        assert r.token_ids == expected and r.stop_reason == "eos"


def test_a_trees_first_n_nodes_cost_the_draft_forwards_that_made_them(pair):
    """A chain of 3 takes 3 draft forwards, issued at tree sizes 1, 2 and 3; its first n nodes need the
    first n of them, so `--budget auto` prices a smaller chain by what it would have cost."""
    session = DraftSession(pair.draft, [0, 3, 1])
    POLICIES["chain"].build(session, 1, 3, 0.0, torch.Generator().manual_seed(0))
    assert session.calls == [(1, 1), (2, 1), (3, 1)]  # (tree size when issued, nodes forwarded)


def test_the_profile_times_each_size_as_the_engine_sends_it(hf_pair, monkeypatch):
    """t(1) is what a step that drafts nothing costs: one token with no mask, as the engine sends
    it; a tree of n > 1 goes with its mask. A masked t(1) was 8% dearer on a CPU, which made drafting
    look cheaper next to not drafting."""
    calls = {"engine": set(), "profile": set()}
    forward = KVSession.forward

    def spy(self, tokens, positions=None, visible=None, **kwargs):
        if self.model is hf_pair.target and self.cached > 0:  # not the prompt's prefill
            calls[who].add((len(tokens), visible is None))
        return forward(self, tokens, positions, visible, **kwargs)

    monkeypatch.setattr(KVSession, "forward", spy)
    who = "engine"
    generate(hf_pair, PROMPT, policy="chain", budget=1, max_new_tokens=4)
    generate(hf_pair, PROMPT, policy="ar", max_new_tokens=4)
    who = "profile"
    forward_ms(hf_pair.target, sizes=(1, 2), repeats=1)
    assert calls["engine"] == calls["profile"] == {(1, True), (2, False)}


def test_sequoia_reads_a_calibrated_vector_and_never_measures_behind_your_back(pair, tmp_path, monkeypatch):
    """Without a measured acceptance vector `sequoia` says how to make one (and views do not offer
    it); `calibrate` saves one per temperature, and a run takes the nearest temperature's."""
    monkeypatch.setenv("DYSPEC_CACHE", str(tmp_path))
    with pytest.raises(DyspecError, match="dyspec calibrate"):
        generate(pair, PROMPT, policy="sequoia", budget=4, max_new_tokens=4)
    assert "sequoia" not in available_policies(pair)
    saved = calibrate(pair, temperatures=(0.0, 1.0), num_prompts=2, width=3, progress=False)
    assert list(saved["acceptance"]) == ["0", "1"]
    assert all(len(a) == 3 and 0 < sum(a) <= 1 for a in saved["acceptance"].values())
    assert "sequoia" in available_policies(pair)
    assert POLICIES["sequoia"].prepare(pair, 0.8, {})["acceptance"] == saved["acceptance"]["1"]
    r = generate(pair, PROMPT, policy="sequoia", budget=4, max_new_tokens=8)
    assert r.token_ids == generate(pair, PROMPT, policy="ar", max_new_tokens=8).token_ids


@torch.inference_mode()
def sglang_brute_force(pair, context: list[int], topk: int, steps: int, budget: int) -> int:
    """Tokens one greedy step commits with SGLang's tree, from full forwards of both tiny models:
    the candidates of every step scored by cumulative draft probability, the best `budget` kept,
    then the target's argmax walked down them (plus its bonus token)."""

    def last(model, path):
        return model(torch.tensor([context + list(path)])).logits[0, -1].float()

    score, frontier = {(): 1.0}, [()]
    for _ in range(steps):
        added = {}
        for path in frontier:
            q = torch.softmax(last(pair.draft, path), -1)
            for p, y in zip(*q.topk(topk)):
                added[(*path, int(y))] = score[path] * float(p)
        score.update(added)
        frontier = sorted(added, key=lambda t: -added[t])[:topk]
    keep = set(sorted((t for t in score if t), key=lambda t: -score[t])[:budget])
    node = ()
    while (*node, int(last(pair.target, node).argmax())) in keep:
        node = (*node, int(last(pair.target, node).argmax()))
    return len(node) + 1


@pytest.mark.parametrize("topk,steps,budget", [(2, 3, 5), (3, 2, 7), (4, 4, 10)])
def test_sglang_policy_commits_what_a_brute_force_count_says(pair, topk, steps, budget):
    steps_seen = []
    r = generate(
        pair,
        PROMPT,
        policy="sglang",
        budget=budget,
        max_new_tokens=12,
        options={"topk": topk, "steps": steps},
        hooks=[steps_seen.append],
    )
    assert r.token_ids == generate(pair, PROMPT, policy="ar", max_new_tokens=12).token_ids
    verified, context = [s for s in steps_seen if isinstance(s, StepVerified)], list(PROMPT)
    for step in verified[:-1]:  # the last one is cut at max_new_tokens
        assert len(step.emitted) == sglang_brute_force(pair, context, topk, steps, budget)
        context += step.emitted
    assert len(verified) > 2


def test_recycling_keeps_its_table_across_a_pairs_generations(pair):
    """Token Recycling's table lives as long as the pair, as the reference keeps it across requests:
    a second generation's first step already drafts from what the first one learnt; `forget` clears it."""
    from dyspec import stream
    from dyspec.core.events import StepVerified
    from dyspec.policies import recycling

    def first_tree_and_tokens() -> tuple[int, list[int]]:
        events = list(stream(pair, [0, 3, 1], "recycling", 8, max_new_tokens=12))
        first = next(e for e in events if isinstance(e, StepVerified))
        return len(first.tokens) - 1, events[-1].token_ids

    recycling.forget(pair)
    cold, tokens = first_tree_and_tokens()
    warm, again = first_tree_and_tokens()
    assert cold == 0 and warm > 0 and again == tokens  # greedy: the same answer whatever the table
    recycling.forget(pair)
    assert first_tree_and_tokens() == (0, tokens)
