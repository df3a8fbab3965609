"""The CPU fast path (int8 Linear layers) and --budget auto."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

from dyspec import generate
from dyspec.auto.budget import (
    AUTO_CAP,
    GROW_MAX,
    PROBE_AFTER,
    PROBE_MAX,
    AutoState,
    Built,
    Growth,
    auto_tree,
    next_auto_cap,
    sampled_keep,
    set_next_cap,
    step_cap,
)
from dyspec.auto.cost import (
    best_prefix_size,
    hull_ms,
    interpolate_ms,
    least_paying_chain,
    padded_profile,
    padded_size,
    profile_at,
)
from dyspec.auto.estimate import (
    Acceptance,
    bin_rates,
    copy_bin,
    estimates,
    first_rate_bound,
    learn,
    node_bins,
    position_values,
    slot_keys,
)
from dyspec.auto.profile import weight_bytes
from dyspec.core.contract import BINS
from dyspec.core.events import StepVerified
from dyspec.core.kv import KVSession
from dyspec.core.tree import Tree
from dyspec.core.verify import verify_sampled
from dyspec.decode.engine import encode_prompt
from dyspec.drafts.feature import features_before, load_feature_draft
from dyspec.errors import DyspecError
from dyspec.forward import attention
from dyspec.forward.attention import rowwise_attention
from dyspec.forward.quant import Int8Linear, SharedInputInt8, SplitInt8Linear, quantize_int8
from dyspec.load import load_pair, shipped_draft
from dyspec.policies import POLICIES

from .conftest import PROMPTS
from .test_engine import session
from .tiny import tiny_model


def test_int8_linear_is_batch_invariant_and_close_to_fp32():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True)
    q = Int8Linear(linear.weight, linear.bias)
    x = torch.randn(9, 64) * torch.logspace(-2, 2, 9)[:, None]  # rows of very different scales
    batch = q(x)
    for i in range(len(x)):
        torch.testing.assert_close(q(x[i : i + 1])[0], batch[i], atol=1e-5, rtol=1e-5)
    ref = linear(x)
    rel = (batch - ref).norm(dim=1) / ref.norm(dim=1)
    assert rel.max() < 0.02


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rowwise_attention_rows_do_not_depend_on_their_batch(threads):
    """Each query row of a tree forward equals, bit for bit, a one-token forward over the keys it
    sees, whatever the other rows and the thread count (SDPA's CPU kernel fails this)."""
    g = torch.Generator().manual_seed(threads)
    n, prefix = 24, 50  # rows see 51 to 74 keys: two padded lengths (64 and 128)
    parents = [-1] + [int(torch.randint(i, (), generator=g)) for i in range(1, n)]
    visible = torch.zeros(n, prefix + n, dtype=torch.bool)
    visible[:, :prefix] = True
    for i in range(n):
        j = i
        while j >= 0:
            visible[i, prefix + j], j = True, parents[j]
    query, key, value = torch.randn(1, 9, n, 64, generator=g), *torch.randn(2, 1, 3, prefix + n, 64, generator=g)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, _ = rowwise_attention(None, query, key, value, visible[None, None])
        for i in range(n):
            seen = visible[i].nonzero().squeeze(1)
            alone, _ = rowwise_attention(None, query[:, :, i : i + 1], key[:, :, seen], value[:, :, seen], None)
            assert torch.equal(alone[0, 0], out[0, i])
    finally:
        torch.set_num_threads(saved)


def test_quantize_int8_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    quantize_int8(model)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2


def test_the_floor_counts_each_weight_a_forward_reads_once_in_its_precision():
    """fp32 Linear weights at 4 bytes, int8 ones at 1 (fused layers too), a tied output layer once,
    the embedding (a row per token) not at all."""
    model = tiny_model(0)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    count = sum(m.weight.numel() for m in linears)
    assert weight_bytes(model) == 4 * count
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: one matrix, read once
    assert weight_bytes(model) == 4 * count
    assert weight_bytes(quantize_int8(copy.deepcopy(tiny_model(0)))) == count


@pytest.mark.parametrize("bias", [False, True])
def test_quantize_int8_fuses_layers_that_share_an_input_bitwise(bias):
    """q/k/v and gate/up become one int8 GEMM each; the model computes bitwise what one int8 layer
    per Linear computes, on a prefill and on tree forwards of several sizes."""
    model = tiny_model(0, layers=2)
    model.config.attention_bias = bias
    if bias:  # a Qwen2-style attention: q, k and v with biases (o without)
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(layer.self_attn, name)
                new = nn.Linear(old.in_features, old.out_features, bias=True)
                setattr(layer.self_attn, name, new)
    one_by_one = copy.deepcopy(model)
    for module in list(one_by_one.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child.weight, child.bias))
    quantize_int8(model)
    assert sum(isinstance(m, SharedInputInt8) for m in model.modules()) == 4
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 4 + 1
    for m in (model, one_by_one):
        m.set_attn_implementation(attention.NAME)
    sessions = [KVSession(model), KVSession(one_by_one)]
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(5, (20,), generator=g).tolist()
    for kv in sessions:
        kv.append(prefix)
    for n in (1, 3, 8):
        tokens = torch.randint(5, (n,), generator=g).tolist()
        visible = torch.ones(n, n, dtype=torch.bool).tril() if n > 1 else None
        fused, separate = (kv.forward(tokens, list(range(20, 20 + n)), visible) for kv in sessions)
        assert torch.equal(fused, separate)
        for kv in sessions:
            kv.commit([])
    assert all(m._last[0] is None for m in model.modules() if isinstance(m, SharedInputInt8))


def test_interpolate_and_best_prefix():
    t = {1: 20.0, 8: 30.0, 64: 90.0}
    assert interpolate_ms(t, 1) == 20.0 and interpolate_ms(t, 4) == pytest.approx(20 + 10 * 3 / 7)
    assert interpolate_ms(t, 128) == pytest.approx(90 + 60 * 64 / 56)
    sunk = lambda n: 5.0  # noqa: E731
    assert best_prefix_size([], t, sunk) == 0
    assert best_prefix_size([0.9, 0.8, 0.7], t, sunk) == 3  # cheap, likely nodes: keep all
    assert best_prefix_size([0.01, 0.01], t, sunk) == 0  # unlikely nodes are not worth verifying
    steep = {1: 10.0, 2: 100.0}
    assert best_prefix_size([0.9], steep, lambda n: 0.0) == 0  # 1.9 tokens for 10x the cost: not worth it
    # draft cost that grows with n (a chain: one draft forward per node). At 30 ms a node even the
    # first one does not pay (1.5 tokens / 51.4 ms < 1 / 20 ms); at 2 ms the first two do.
    assert best_prefix_size([0.5, 0.25, 0.12], t, lambda n: 30.0 * n) == 0
    assert best_prefix_size([0.5, 0.25, 0.12], t, lambda n: 2.0 * n) == 2


def test_auto_budget_is_exact_and_adapts(pair):
    expected = generate(pair, PROMPTS[0], policy="ar", max_new_tokens=24).token_ids
    state, steps = AutoState(), []
    kwargs = {"policy": "dyspec", "budget": "auto", "auto_state": state}
    r = generate(pair, PROMPTS[0], max_new_tokens=24, hooks=[steps.append], **kwargs)
    assert r.token_ids == expected
    sizes = {len(s.tokens) - 1 for s in steps if isinstance(s, StepVerified)}
    assert max(sizes) < 64
    # what auto learnt carries to the next generation that is given the same state, and stays exact
    assert sum(state.acceptance.reached) > sum(Acceptance().reached)
    learnt = list(state.acceptance.reached)
    state.growth.cap = 4  # whether drafting paid in the first answer depends on this machine's speed
    expected = generate(pair, PROMPTS[1], policy="ar", max_new_tokens=16).token_ids
    assert generate(pair, PROMPTS[1], max_new_tokens=16, **kwargs).token_ids == expected
    assert state.acceptance.reached != learnt


@pytest.fixture(scope="module")
def int8_pair():
    """The fast path: int8 target, with the feature draft shipped for it (`auto`)."""
    return load_pair(precision="int8")


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"ar"}))
def test_int8_path_greedy_identity(int8_pair, policy):
    assert int8_pair.precision == "int8" and int8_pair.draft_name == "distilled"
    options = {
        "sequoia": {"acceptance": [0.3, 0.1, 0.05]},
        "specdecpp": {"min_k": 1},  # the head shipped for this pair
        "lookup": {"min_ngram": 1, "fallback": 1},
    }.get(policy, {})
    for prompt in PROMPTS[:2]:
        expected = generate(int8_pair, prompt, policy="ar", max_new_tokens=32).token_ids
        got = generate(int8_pair, prompt, policy=policy, budget=12, max_new_tokens=32, options=options).token_ids
        assert got == expected


def test_int8_path_quantizes_the_feature_draft(pair, int8_pair):
    """The shipped feature draft runs with an int8 input projection (each half of its input row
    quantized on its own scale), decoder layer and output rows on the fast path, and proposes what
    its fp32 weights propose on most tokens."""
    draft = int8_pair.draft
    assert draft.borrowed.int8_head is not None and isinstance(draft.layers[0].mlp.down_proj, Int8Linear)
    assert isinstance(draft.fc, SplitInt8Linear)
    folder = shipped_draft(pair.target_name)
    fp32, int8 = load_feature_draft(folder, pair.target), load_feature_draft(folder, pair.target)
    int8.quantize_int8()
    agree = []
    for prompt in PROMPTS:
        ids = encode_prompt(pair, prompt, True)
        with torch.inference_mode():
            h = pair.target(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            top = [KVSession(d).forward(ids, features=features_before(h)).argmax(-1) for d in (fp32, int8)]
        assert set(top[1].tolist()) <= set(int8.vocab.tolist())
        agree += (top[0] == top[1]).tolist()
    assert sum(agree) / len(agree) >= 0.9


def test_int8_path_quantizes_an_independent_draft_and_stays_exact():
    pair = load_pair(draft="truncated:2", precision="int8")
    assert any(isinstance(m, Int8Linear) for m in pair.draft.modules())
    expected = generate(pair, PROMPTS[0], policy="ar", max_new_tokens=32).token_ids
    assert generate(pair, PROMPTS[0], policy="dyspec", budget=12, max_new_tokens=32).token_ids == expected


def test_fp32_precision_keeps_full_precision_layers():
    """`--precision fp32`: the GPU's exact mode; on a CPU the fp32 target as loaded, no int8 layers."""
    pair = load_pair(draft="distilled", precision="fp32")
    assert pair.precision == "fp32" and pair.dtype == torch.float32
    assert not any(isinstance(m, Int8Linear) for m in pair.target.modules())
    with pytest.raises(DyspecError, match="auto, native, fp32, int8"):
        load_pair(precision="fp16")


@pytest.mark.parametrize("cache", ["dynamic", "static", "lean"])
def test_int8_tree_forward_is_bitwise_a_sequential_decode(int8_pair, cache):
    """On the int8 path every tree node's logits equal, bit for bit, those of decoding its root
    path one token at a time: the property that keeps greedy speculative decoding exact there; on
    the static path too (a bucket's padding and the stale slots never join a row's keys), and on
    the lean forward (whose one-token forwards read the cache in place, its stale slots too)."""
    pair = int8_pair
    g = torch.Generator().manual_seed(1)
    prefix = encode_prompt(pair, PROMPTS[4])
    tree = Tree.root(prefix[-1])
    for _ in range(10):
        tree.add(int(torch.randint(len(tree), (), generator=g)), int(torch.randint(49152, (), generator=g)), 1.0)

    def prefilled(role: str):
        kv = session(pair.target, cache, role=role)
        kv.append(prefix[:-1])
        return kv

    kv = prefilled("tree")
    logits = kv.forward(tree.tokens, [kv.length + d for d in tree.depths], tree.ancestor_mask())
    for node in range(len(tree)):
        seq = prefilled("sequential")
        for token in [tree.tokens[0]] + [tree.tokens[i] for i in tree.path(node)]:
            last = seq.forward([token])[-1]
        assert torch.equal(last, logits[node])


def test_auto_budget_at_t_above_0_ignores_the_drawn_token():
    """q = (0.9, 0.1), p = (0.5, 0.5) and a node that costs half a step: worth it for a token of
    value 0.9, not 0.1. Keeping the drafted token only when the draft liked it would output token 0
    with probability 0.55."""
    q, p = torch.tensor([0.9, 0.1]), torch.tensor([0.5, 0.5])
    steep = {1: 10.0, 2: 15.0}
    g = torch.Generator().manual_seed(0)
    runs, zeros = 20000, 0
    for _ in range(runs):
        tree = Tree.root(0, "iid")
        tree.q[0] = q
        x = int(torch.multinomial(q, 1, generator=g))
        tree.add(0, x, float(q[x]))
        keep = sampled_keep(
            tree,
            estimates(bin_rates(Acceptance(), sampled=True), tree, node_bins(tree, sampled=True)),
            steep,
            rate=0.05,
        )  # value 0.5 (the prior), worth it from 0.25
        accepted, token = verify_sampled(tree.subtree(keep)[0], p[None].expand(1 + len(keep), 2), g)
        zeros += (tree.tokens[accepted[0]] if accepted else token) == 0
    assert abs(zeros / runs - 0.5) < 4 * (0.25 / runs) ** 0.5


def test_slot_keys_do_not_read_the_node_itself():
    tree = Tree.root(0, "without_replacement")
    tree.q[0] = torch.tensor([0.6, 0.3, 0.1])
    a = tree.add(0, 0, 0.6)
    tree.add(0, 1, 0.3)
    tree.q[a] = torch.tensor([0.5, 0.5, 0.0])
    tree.add(a, 2, 0.0)
    assert slot_keys(tree) == pytest.approx([0.46, 0.10, 0.5])  # sum q^2, less the earlier siblings'
    tree.tokens[2], tree.draft_probs[2] = 2, 0.1  # another draw there: its own key stays
    assert slot_keys(tree) == pytest.approx([0.46, 0.10, 0.5])


def test_estimates_learn_acceptance_per_bin():
    """A node's value is the product over its path of the acceptance rate seen for its bin; before
    any evidence, the draft's own probability."""
    acc = Acceptance()
    tree = Tree.root(0, "deterministic")
    a = tree.add(0, 1, 0.95)
    tree.add(a, 2, 0.35)
    assert estimates(bin_rates(acc, sampled=False), tree, node_bins(tree, sampled=False)) == pytest.approx(
        [0.95, 0.95 * 0.35]
    )
    for _ in range(40):  # the likely token always accepted, the unlikely one always rejected
        learn(acc, tree, node_bins(tree, sampled=False), [a], 100.0)
    likely, unlikely = estimates(bin_rates(acc, sampled=False), tree, node_bins(tree, sampled=False))
    assert likely > 0.98 and unlikely < 0.05
    assert acc.tokens_per_ms == pytest.approx(0.02)  # 2 tokens per 100 ms


def test_chosen_later_siblings_do_not_price_the_chain():
    """DySpec at T = 0: the top child (q = 0.9) always accepted, its unlikely siblings (q = 0.05)
    never. They bin apart, so the first children's pooled rate, which decides whether drafting
    stops, is the chain's (it read ~0.3 for the int8 draft when siblings were pooled in)."""
    tree = Tree.root(0, "deterministic")
    a = tree.add(0, 1, 0.9)
    for token in (2, 3, 4):
        tree.add(0, token, 0.05)
    assert node_bins(tree, sampled=False) == [9, BINS, BINS, BINS]
    acc = Acceptance()
    for _ in range(20):
        learn(acc, tree, node_bins(tree, sampled=False), [a], 100.0)
    assert first_rate_bound(acc) > 0.95


def test_copy_steps_and_drafting_steps_fade_only_their_own_evidence():
    """`lookup` copies on ~1 step in 10: its copy rates, faded by every step, stayed at their prior."""
    acc = Acceptance()
    tree = Tree.root(0, "deterministic")
    tree.add(0, 1, 0.95)
    learn(acc, tree, [copy_bin(3)], [1], 30.0)
    learn(acc, tree, node_bins(tree, sampled=False), [1], 30.0)
    assert acc.reached[copy_bin(3)] == 1.0 and acc.reached[9] == 1.0 and acc.depth_reached[0] == 1.0
    learn(acc, tree, [copy_bin(3)], [], 30.0)
    assert acc.reached[copy_bin(3)] == 1.95 and acc.accepted[copy_bin(3)] == 0.95
    assert acc.reached[9] == 1.0 and acc.depth_reached[0] == 1.0
    learn(acc, tree, node_bins(tree, sampled=False), [], 30.0)
    assert acc.reached[9] == 1.95 and acc.depth_reached[0] == 1.95 and acc.reached[copy_bin(3)] == 1.95


def test_t_n_behind_a_context_moves_by_what_the_longer_context_measured():
    """The int8 path's tree tokens cost more behind a longer context; the short profile's lumps stay."""
    short = {1: 20.0, 2: 22.0, 3: 30.0, 4: 24.0, 8: 28.0}
    profiles = {100: short, 400: {1: 22.0, 4: 30.0, 8: 42.0}}  # 2, 6 and 14 ms more
    assert profile_at(profiles, 100) == profile_at(profiles, 60) == short == profile_at({100: short}, 400)
    at_400 = {1: 22.0, 2: 22.0 + 2 + 4 / 3, 3: 30.0 + 2 + 8 / 3, 4: 30.0, 8: 42.0}
    assert profile_at(profiles, 400) == pytest.approx(at_400) and profile_at(profiles, 900) == pytest.approx(at_400)
    assert profile_at(profiles, 250) == pytest.approx({n: (short[n] + at_400[n]) / 2 for n in short})


def test_a_forward_is_padded_to_the_cheapest_measured_size_a_few_tokens_up():
    """t(3) and t(7) above their next sizes, as fp32 forwards on a 2-core AMD EPYC measured."""
    profile = {1: 55.0, 2: 90.0, 3: 108.0, 4: 80.0, 5: 74.0, 6: 74.0, 7: 94.0, 8: 74.0, 16: 90.0, 32: 150.0}
    assert [padded_size(profile, n) for n in range(1, 10)] == [1, 5, 5, 5, 5, 6, 8, 8, 9]
    assert [padded_size(profile, n) for n in (9, 12, 16)] == [9, 12, 16]  # t(16) is above the line to it
    far = {1: 10.0, 2: 50.0, 8: 20.0}  # a cheaper size more than PAD_MAX tokens up is not taken
    assert (padded_size(far, 2), padded_size(far, 4)) == (2, 8)
    assert padded_profile(profile) == {**profile, 2: 74.0, 3: 74.0, 4: 74.0, 7: 74.0}


def test_next_auto_cap_is_a_little_more_than_what_paid():
    assert [next_auto_cap(n, 1) for n in (0, 3, 8, 16, 63)] == [1, 4, 9, 17, 64]  # a chain: one node more
    assert next_auto_cap(8, 4) == 12 and next_auto_cap(8, 0) == 9  # one more draft forward's nodes


def test_auto_stops_drafting_where_nothing_pays_and_probes_less_each_time():
    state = AutoState()
    set_next_cap(state.growth, 0, room=3, stop=True)  # the first tree paid nothing: a short run, so the wait doubles
    assert (state.growth.cap, state.growth.probe_cap, state.growth.probe_after) == (0, 3, 2 * PROBE_AFTER)
    assert [step_cap(dataclasses.replace(state.growth, idle=i)) for i in (0, 15, 16)] == [0, 0, 3]
    for _ in range(5):
        set_next_cap(state.growth, 0, room=3, stop=True)
    assert state.growth.probe_after == PROBE_MAX
    set_next_cap(state.growth, 2, room=3, stop=False)  # a probe that pays: drafting resumes
    assert state.growth.cap == 5 and step_cap(state.growth) == 5
    for _ in range(PROBE_AFTER):
        set_next_cap(state.growth, 2, room=3, stop=False)
    set_next_cap(state.growth, 0, room=1, stop=True)  # after a long run that paid, the first probe comes soon
    assert (state.growth.cap, state.growth.probe_cap, state.growth.probe_after) == (0, 1, PROBE_AFTER)


def test_the_cap_grows_where_everything_paid_and_bets_less_often_where_growing_did_not():
    state = AutoState()
    caps = []
    for worth, paid in [(1, True), (1, False), (1, True), (1, True), (1, False), *[(1, True)] * 4, (2, True)]:
        set_next_cap(state.growth, worth, room=1, stop=False, paid=paid)
        caps.append(state.growth.cap)
    # grow, the grown tree did not pay in full (wait 2), 2 steps paid, grow, no (wait 4), 4 paid,
    # grow, and the grown tree paid: grow again at once
    assert caps == [2, 1, 1, 2, 1, 1, 1, 1, 2, 3] and state.growth.grow_after == 1
    for _ in range(40):  # every grown tree fails: the wait doubles to at most GROW_MAX
        set_next_cap(state.growth, 1, room=1, stop=False, paid=not state.growth.grew)
    assert state.growth.grow_after == GROW_MAX


@pytest.mark.parametrize("accepted,cap", [(60.0, 2), (5.0, 0)])
def test_one_unsure_node_stops_drafting_only_if_past_nodes_say_so(accepted, cap):
    """A chain's one node, chosen at q = 0.15 (bin 1, no evidence: worth 0.15), does not pay by
    its own value (1.15 tokens / 14.5 ms < 1 / 10 ms), and the cut drops it. The next cap reads
    what first children were worth in past steps: accepted 60% of the time, a node pays (1.6 /
    14.5 ms), and as everything built paid the cap grows by one; at 5% drafting stops."""
    tree = Tree.root(0, "deterministic")
    tree.add(0, 1, 0.15)
    reached, accepted_counts = [0.0] * 2 * BINS, [0.0] * 2 * BINS
    reached[8], accepted_counts[8] = 100.0, accepted
    state = AutoState(Acceptance(reached=reached, accepted=accepted_counts))
    auto_tree(state, tree, Built(False, 4.0, lambda n: 4.0, per_forward=1), {1: 10.0, 2: 10.5})
    assert state.growth.cap == cap


@pytest.mark.parametrize("accepted,reached,cap", [(8.0, 20.0, 1), (5.0, 100.0, 0)])
def test_an_unsure_sampled_step_stops_drafting_only_if_one_node_might_pay(accepted, reached, cap):
    """A sampled chain's one node, valued at the first children's pooled rate ((8 + 1) / (20 + 2),
    0.41: 1.41 tokens / 14.5 ms < 1 / 10 ms), does not pay. A stop is dear, so drafting stops only
    where one node would not pay at one standard error above that rate either: 0.51 pays; with 5 of
    100 accepted, 0.08 does not."""
    tree = Tree.root(0, "iid")
    tree.q[0] = torch.full((20,), 0.05)
    tree.add(0, 1, 0.05)
    tree.end_expansion()
    reached_counts, accepted_counts = [0.0] * 2 * BINS, [0.0] * 2 * BINS
    reached_counts[9], accepted_counts[9] = reached, accepted
    state = AutoState(Acceptance(reached=reached_counts, accepted=accepted_counts))
    auto_tree(state, tree, Built(True, 4.0, lambda n: 4.0, per_forward=1), {1: 10.0, 2: 10.5})
    assert state.growth.cap == cap


# fp32 forwards of the default target on a 2-core AMD EPYC: t(2) far above t(1), t(4) below t(2)
NOT_CONVEX = {1: 70.0, 2: 114.0, 4: 103.0, 8: 126.0, 16: 157.0}


def test_a_chain_can_pay_where_one_node_cannot():
    """With the profile above and a 23 ms draft forward, one node accepted 85% of the time makes
    1.85 tokens in 137 ms (< 1 / 70 ms) but two make 2.57 in 154.5 ms. Where t(n) is convex, a chain
    pays where one node does, or not at all."""
    assert least_paying_chain(0.85, NOT_CONVEX, 23.0, AUTO_CAP) == 2
    assert least_paying_chain(0.3, NOT_CONVEX, 23.0, AUTO_CAP) == 0
    convex = {1: 10.0, 2: 10.5}
    assert least_paying_chain(0.5, convex, 4.0, AUTO_CAP) == 1 and least_paying_chain(0.2, convex, 4.0, AUTO_CAP) == 0


@pytest.mark.parametrize("reached,accepted", [(100.0, 90.0), (1.0, 0.0)])
def test_auto_keeps_drafting_where_only_a_chain_pays(reached, accepted):
    """A chain's one node never pays at the profile above, but two or more do: `auto` must not stop
    drafting (it did: 0 nodes a step for the default pair, where budget 4 made 1.2-1.3x of `ar`),
    and the next cap is a chain that pays. Where 90 of 100 first children were accepted, and where
    one was rejected: too little evidence to lower the bound below its prior (0.85; one rejection
    alone puts it at 0.6, where no chain pays, and an answer's first token is often unsure)."""
    tree = Tree.root(0, "deterministic")
    tree.add(0, 1, 0.95)
    reached_counts, accepted_counts = [0.0] * 2 * BINS, [0.0] * 2 * BINS
    reached_counts[9], accepted_counts[9] = reached, accepted
    state = AutoState(Acceptance(reached=reached_counts, accepted=accepted_counts))
    auto_tree(state, tree, Built(False, 23.0, lambda n: 23.0 * n, per_forward=1), NOT_CONVEX)
    bound = max(first_rate_bound(state.acceptance), first_rate_bound(Acceptance()))
    assert state.growth.cap == least_paying_chain(bound, NOT_CONVEX, 23.0, AUTO_CAP) > 1


def test_auto_cut_with_chosen_children_keeps_the_most_valuable_nodes():
    """root -> a (0.95), b (0.05), c (0.05); a -> d (0.95): two nodes pay, and they are a and d,
    not the first two by id (a and b); the cut scales the profile by what verification measured."""
    tree = Tree.root(0, "deterministic")
    a = tree.add(0, 1, 0.95)
    tree.add(0, 2, 0.05)
    tree.add(0, 3, 0.05)
    d = tree.add(a, 4, 0.95)
    tree.extra = {"predicted_acceptance": [0.1, 0.2, 0.3, 0.4], "note": "kept"}  # per node lists follow the cut
    profile = {1: 10.0, 3: 12.0, 5: 30.0}
    state = AutoState()
    pruned, old_ids, bins = auto_tree(state, tree, Built(False, 10.0, lambda n: 10.0, per_forward=2), profile)
    assert old_ids == [0, a, d] and pruned.parents == [-1, 0, 1] and bins == [9, 9]
    assert pruned.extra == {"predicted_acceptance": [0.1, 0.4], "note": "kept"}
    # the next cap reads past steps' rates per position (none yet: 1/2 a node), not this step's
    # draft probabilities: no node pays (1.5 tokens / 21 ms), but a chain at the bound might
    assert state.growth.cap == 1
    # verification 100x cheaper: next to 10 ms of drafting, every node pays
    cheap = {n: ms / 100 for n, ms in profile.items()}
    assert auto_tree(state, tree, Built(False, 10.0, lambda n: 10.0, per_forward=2), cheap)[1] == [0, 1, 2, 3, 4]


def test_auto_cuts_copies_by_the_rate_learnt_for_their_match_length():
    """Copies after a 2-token match were accepted 0.3 of the time, after 3 or more 0.9: the same
    chain of 8 copies is cut to 1 or kept whole, by its match, and leaves the cap alone."""
    tree = Tree.root(0, "deterministic")
    for token in range(1, 9):
        tree.add(tree.size, token, 1.0)
    state = AutoState(growth=Growth(cap=5))
    state.acceptance.reached[copy_bin(2)], state.acceptance.accepted[copy_bin(2)] = 100.0, 30.0
    state.acceptance.reached[copy_bin(3)], state.acceptance.accepted[copy_bin(3)] = 100.0, 90.0
    profile = {1: 10.0, 2: 11.0, 64: 74.0}  # 1 ms a node
    for match, kept in ((2, 1), (3, 8)):
        built = Built(False, 0.0, lambda n: 0.0, 8, copied=match)
        pruned, old_ids, bins = auto_tree(state, tree, built, profile, sets_cap=False)
        assert pruned.size == kept and bins == [copy_bin(match)] * kept and state.growth.cap == 5
    assert copy_bin(1) < copy_bin(2) < copy_bin(3) == copy_bin(4) - 1 == copy_bin(9) - 1


@pytest.mark.parametrize("grows_by_values,cap", [(True, 3), (False, 10)])
def test_auto_cap_with_sampled_children(grows_by_values, cap):
    """root -> a -> d -> e (first children, learnt rate ~1) and 5 later siblings of a (rate ~0),
    built in 2 nodes per draft forward: the cut keeps the chain. DySpec, which grows by these
    values, would build about the chain at a cap of its size: 3 nodes worth it, and no room, since
    not everything built paid. A static shape counts every node in id order: all 8 pay together,
    so 2 more for one draft forward."""
    tree = Tree.root(0, "without_replacement")
    for u, token in [(0, 1), *[(0, t) for t in range(2, 7)], (1, 7), (7, 8)]:
        tree.q[u] = torch.full((10,), 0.1)
        tree.add(u, token, 0.1)
    state = AutoState(Acceptance(reached=[100.0] * 2 * BINS, accepted=[100.0] * BINS + [0.0] * BINS))
    profile = {1: 10.0, 64: 73.0}
    _, old_ids, _ = auto_tree(state, tree, Built(True, 10.0, lambda n: 10.0, 2, grows_by_values), profile)
    assert old_ids == [0, 1, 7, 8] and state.growth.cap == cap


@pytest.mark.parametrize("grows_by_values,cap", [(True, 2), (False, 9)])
def test_a_static_shapes_cap_follows_position_not_this_steps_keys(grows_by_values, cap):
    """A sampled chain of 8 whose third slot had a flat q (key bin 0, learnt rate ~0.04): the cut
    drops it and what follows. The next step's keys are not this step's, so a static shape's next
    cap values its nodes by the first children's pooled rate (~0.95) and grows by one; DySpec's
    follows its kept nodes (2 worth it, no room: not everything built paid)."""
    tree = Tree.root(0, "iid")
    for node in range(8):
        tree.q[node] = torch.full((20,), 0.05) if node == 2 else torch.tensor([0.981] + [0.001] * 19)
        tree.add(node, 0, 0.5)
        tree.end_expansion()
    assert node_bins(tree, sampled=True) == [9, 9, 0, 9, 9, 9, 9, 9]
    reached, accepted = [0.0] * 2 * BINS, [0.0] * 2 * BINS
    reached[0], reached[9], accepted[9] = 50.0, 1000.0, 1000.0
    state = AutoState(Acceptance(reached=reached, accepted=accepted))
    profile = {1: 10.0, 64: 73.0}
    _, old_ids, _ = auto_tree(state, tree, Built(True, 8.0, lambda n: 1.0 * n, 1, grows_by_values), profile)
    assert old_ids == [0, 1, 2] and state.growth.cap == cap


def test_position_values_learn_first_children_per_depth():
    """A sampled chain of 3: first children are accepted 90% at depth 1 and 10% at depth 2, and
    nothing is known at depth 3 (prior: all first children, 1/2 before any evidence)."""
    tree = Tree.root(0, "iid")
    for node in range(3):
        tree.q[node] = torch.tensor([0.5, 0.5])
        tree.add(node, 0, 0.5)
        tree.end_expansion()
    bins = node_bins(tree, sampled=True)
    acc = Acceptance(depth_reached=[100.0, 100.0, 0.0, 0.0], depth_accepted=[90.0, 10.0, 0.0, 0.0])
    d1, d2 = 91 / 102, 11 / 102
    assert position_values(acc, tree, bins) == pytest.approx([d1, d1 * d2, d1 * d2 * 0.5])
    acc = Acceptance()
    learn(acc, tree, bins, [1], 30.0)  # node 1 accepted, 2 not
    assert acc.depth_reached == [1.0, 1.0, 0.0, 0.0] and acc.depth_accepted == [1.0, 0.0, 0.0, 0.0]


def test_hull_and_sampled_keep():
    lumpy = {1: 60.0, 2: 112.0, 4: 91.0, 8: 91.0, 16: 102.0}  # measured on this CPU: t(2) > t(4)
    hull = hull_ms(lumpy)
    assert interpolate_ms(hull, 2) == pytest.approx(60 + 42 / 15)
    assert all(interpolate_ms(hull, n) <= ms + 1e-9 for n, ms in lumpy.items())
    # root -> a (value 0.9), b (0.05), c (0.5); a -> d (0.8): b is not worth 2.8 ms at 0.1 tokens/ms,
    # so c, its later sibling (drawn after b was), goes with it; d stays.
    tree = Tree.root(0, "without_replacement")
    for parent, token in [(0, 1), (0, 2), (0, 3), (1, 4)]:
        tree.add(parent, token, 0.5)
    assert sampled_keep(tree, [0.9, 0.05, 0.5, 0.8], lumpy, rate=0.1) == [1, 4]


def test_a_node_is_never_worth_more_than_its_parent():
    """The T = 0 cut keeps the most valuable nodes, which is closed under ancestors only if no value
    rounds above its parent's; rates of exactly 1 (no rejection yet) are the usual case."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        reached = (torch.rand(2 * BINS, generator=g, dtype=torch.float64) * 30 + 0.1).tolist()
        share = torch.rand(2 * BINS, generator=g, dtype=torch.float64).clamp(min=0.5).tolist()  # 0.5: rate 1
        acc = Acceptance(reached=reached, accepted=[r if f == 0.5 else r * f for r, f in zip(reached, share)])
        tree = Tree.root(0, "without_replacement")
        for s in range(1, 40):
            u = int(torch.randint(s, (1,), generator=g))
            tree.q[u] = torch.softmax(torch.randn(50, generator=g), 0)
            tree.add(u, s, float(torch.rand(1, generator=g)))
        for sampled in (False, True):
            values = [1.0, *estimates(bin_rates(acc, sampled), tree, node_bins(tree, sampled))]
            assert all(values[s] <= values[tree.parents[s]] for s in range(1, len(tree)))


def test_sampled_first_children_and_later_siblings_learn_apart():
    """Sampled children: a first child with a flat proposal (key 0.1, accepted) and its later
    sibling (key ~0.08, rejected) would share a bin by key alone. Apart, each learns its own rate,
    and a first child in a bin never measured takes its group's rate, not the bin's centre."""
    tree = Tree.root(0, "without_replacement")
    tree.q[0] = torch.full((10,), 0.1)
    a = tree.add(0, 1, 0.1)
    tree.add(0, 2, 0.1)
    bins = node_bins(tree, sampled=True)
    assert bins == [1, BINS]
    acc = Acceptance()
    assert estimates(bin_rates(acc, sampled=True), tree, bins) == pytest.approx([0.5, 0.5])
    for _ in range(40):
        learn(acc, tree, bins, [a], 100.0)
    first, later = estimates(bin_rates(acc, sampled=True), tree, bins)
    assert first > 0.95 and later < 0.05
    sure = Tree.root(0, "without_replacement")
    sure.q[0] = torch.tensor([0.9, 0.1])
    sure.add(0, 0, 0.9)
    assert node_bins(sure, sampled=True) == [8] and estimates(bin_rates(acc, sampled=True), sure, [8])[0] > 0.9


def test_a_padded_batch_under_rowwise_attention_does_not_attend_to_its_padding():
    """Hugging Face's batched `generate` pads on the left. Hugging Face builds no mask for an
    attention name it does not know, so under the int8 path's attention every padded sequence read
    its padding: answers of 1 to 13 tokens, or other answers than the model's, from the first token on."""
    model = tiny_model(0, layers=2)
    model.set_attn_implementation(attention.NAME)
    short, long = [3, 1, 2], [0, 4, 1, 3, 2, 2]
    batch = torch.tensor([[0] * (len(long) - len(short)) + short, long])
    mask = torch.tensor([[0] * (len(long) - len(short)) + [1] * len(short), [1] * len(long)])
    with torch.inference_mode():
        padded = model(batch, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
        for row, seq in enumerate((short, long)):
            alone = model(torch.tensor([seq])).logits[0]
            torch.testing.assert_close(padded[row, -len(seq) :], alone, atol=1e-5, rtol=1e-5)


def test_rowwise_attention_appends_several_tokens_to_a_cache_causally():
    """Hugging Face's assisted generation verifies its candidates as one causal forward over the
    cache: under the int8 path's attention such a block read the cache's first keys instead of its
    own prefix (SDPA's `is_causal` aligns the block top-left), and every assisted answer was garbage
    after its first token."""
    model = tiny_model(0, layers=2)
    model.set_attn_implementation(attention.NAME)
    ids = torch.tensor([[0, 4, 1, 3, 2, 2, 1, 0]])
    with torch.inference_mode():
        full = model(ids).logits[0]
        head = model(ids[:, :5], use_cache=True)
        block = model(ids[:, 5:], past_key_values=head.past_key_values, use_cache=True).logits[0]
    torch.testing.assert_close(block, full[5:], atol=1e-5, rtol=1e-5)
