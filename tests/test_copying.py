"""Copying from the context's repeats (dyspec.core.copying): the search `lookup` and a copying draft
share, the mixture a copying draft proposes from, and the fit of its weights (dyspec.train.distill)."""

import dataclasses
import json

import pytest
import torch

from dyspec import generate
from dyspec.core import entries
from dyspec.core.copying import MATCHES, copied, copy_token, mix
from dyspec.core.draft import DraftSession
from dyspec.core.sampling import to_probs
from dyspec.core.tree import Tree
from dyspec.drafts.feature import CONFIG_NAME, load_feature_draft, save_feature_draft
from dyspec.errors import DyspecError
from dyspec.train.distill import copy_agreement, fit_copy_weights

from .tiny import tiny_feature_pair


def brute_copied(context, ngram, min_ngram, k):
    """What `copied` should return, by trying every earlier start for every n and extending
    the context one copied token at a time."""
    for n in range(ngram, min_ngram - 1, -1):
        starts = [i for i in range(len(context) - n) if n < len(context) and context[i : i + n] == context[-n:]]
        if starts:
            extended = list(context)
            while len(extended) < len(context) + k:
                extended.append(extended[starts[-1] + n + len(extended) - len(context)])
            return extended[len(context) :], n
    return [], 0


def test_copies_follow_the_latest_longest_match():
    context = [5, 6, 7, 9, 2, 6, 7, 8, 1, 5, 6, 7]
    assert copied(context, 3, 2, 2) == ([9, 2], 3)  # [5, 6, 7] at 0, over [6, 7] at 5
    assert copied(context, 2, 2, 3) == ([8, 1, 5], 2)  # the latest [6, 7]
    assert copied(context, 3, 2, 9) == (context[3:], 3)  # up to the end of the context
    assert copied(context, 3, 2, 11) == (context[3:] + [9, 2], 3)  # and on, as a loop of 9
    assert copied([1, 2, 1, 2], 3, 1, 5) == ([1, 2, 1, 2, 1], 2)
    assert copied([1, 2, 3, 4], 3, 1, 4) == ([], 0)
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([0, 1, 256, 65536, 65792, 49151])  # byte patterns that also match across ids
    for _ in range(600):
        context = ids[torch.randint(len(ids), (int(torch.randint(1, 14, (), generator=g)),), generator=g)].tolist()
        for ngram, min_ngram, k in ((3, 2, 4), (2, 1, 2), (4, 1, 8)):
            assert copied(context, ngram, min_ngram, k) == brute_copied(context, ngram, min_ngram, k)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_mix_adds_the_copy_to_the_drafts_distribution(temperature):
    """At T > 0 the mixture is what policies draw from; at T = 0 its argmax is the proposal."""
    logits = torch.tensor([1.0, -0.5, float("-inf"), 2.0, 0.3])  # token 2 is outside the draft's vocabulary
    tau = temperature or 1.0
    q = to_probs(logits, tau)
    for token, weight, copy_wins in ((2, 0.5, True), (1, 0.1, False), (0, 0.05, False), (4, 0.9, True)):
        mixed = mix(logits[None], [token], [weight], temperature)[0]
        expected = (1 - weight) * q
        expected[token] += weight
        torch.testing.assert_close(to_probs(mixed, tau), expected)
        assert (int(mixed.argmax()) == token) == copy_wins
    assert logits[2] == float("-inf") and logits[3] == 2.0  # the draft's logits are left as they were


def test_copy_token_weighs_the_copy_by_the_length_of_the_match():
    weights = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    assert copy_token([5, 6, 7, 9, 5, 6, 7], weights) == (9, 0.3)  # [5, 6, 7] repeats
    assert copy_token([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7], weights) == (8, 0.6)  # 7 tokens: 6 or more
    assert copy_token([1, 2, 3], weights) == (-1, 0.0)


def test_fit_copy_weights_picks_the_smallest_weight_that_agrees_most():
    """Rows: (match length, copy right, draft right, q of the copy, max q). The mixture's argmax is
    the copy where w / (1 - w) > max q - q(copy)."""
    rows = [(6, True, False, 0.1, 0.5)] * 3 + [(7, False, True, 0.1, 0.5)]  # copying: 3 right of 4, not 1
    rows += [(1, False, True, 0.2, 0.6)] * 5  # the copy is wrong, the draft right: never copy
    rows += [(2, True, False, 0.3, 0.4)]  # copy where w / (1 - w) > 0.1
    rows += [(0, False, True, 0.0, 0.9)] * 2  # nothing repeats
    weights = fit_copy_weights(rows)
    assert weights == [0.0, 0.1, 0.0, 0.0, 0.0, 0.3] and len(weights) == MATCHES
    assert copy_agreement(rows, weights) == pytest.approx(11 / 12)
    assert copy_agreement(rows, [0.0] * MATCHES) == pytest.approx(8 / 12)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_copying_draft_mixes_each_nodes_copy_into_its_distribution(temperature):
    """A node's context is the committed tokens and its path; the copy's weight is its match's."""
    draft = tiny_feature_pair().draft
    prompt = [0, 3, 1, 2, 0]
    weights = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    plain, copying = DraftSession(draft, prompt, temperature), DraftSession(draft, prompt, temperature)
    copying.copy_weights = weights
    hidden = torch.randn(len(prompt) - 1, 32, generator=torch.Generator().manual_seed(0))
    tree = Tree.root(0)
    a, c = tree.add(0, 3, 0.5), tree.add(0, 4, 0.5)
    b = tree.add(a, 1, 0.5)
    calls = ([0], [a, c], [b])
    for session in (plain, copying):
        session.set_prompt_features(hidden)
    got = [(plain.logits(tree, nodes), copying.logits(tree, nodes)) for nodes in calls]
    # root: [0] repeats, and 3 followed it (outside the draft's vocabulary [0, 1, 2, 4]: that call
    # spans the target's); a = 3: [0, 3] repeats, 1 followed; c = 4 repeats nothing; b = 1 after a:
    # [0, 3, 1] repeats, 2 followed (columns 1 and 2 of the draft's vocabulary)
    assert plain.vocab.ids.tolist() == [0, 1, 2, 4] and [g[0].shape[-1] for g in got] == [4, 4, 4]
    assert [g[1].shape[-1] for g in got] == [5, 4, 4]
    widened = plain.vocab.widen(got[0][0][0], float("-inf"))
    torch.testing.assert_close(got[0][1][0], mix(widened[None], [3], [0.3], temperature)[0])
    torch.testing.assert_close(got[1][1][0], mix(got[1][0][:1], [1], [0.4], temperature)[0])
    torch.testing.assert_close(got[1][1][1], got[1][0][1])
    torch.testing.assert_close(got[2][1][0], mix(got[2][0][:1], [2], [0.5], temperature)[0])
    assert to_probs(got[0][1], temperature or 1.0)[0, 3] == pytest.approx(0.3)  # all the copy's weight


@pytest.mark.parametrize("policy,budget", [("chain", 4), ("dyspec", 8), ("specinfer", 6), ("lookup", 2)])
def test_a_copying_draft_keeps_greedy_outputs(policy, budget):
    pair = tiny_feature_pair()
    prompt = [0, 3, 1, 2, 0, 3, 1, 4, 0]
    ar = generate(pair, prompt, policy="ar", max_new_tokens=30).token_ids
    plain = generate(pair, prompt, policy=policy, budget=budget, max_new_tokens=30)
    pair.draft.copy_weights = [0.9] * MATCHES
    copying = generate(pair, prompt, policy=policy, budget=budget, max_new_tokens=30)
    assert plain.token_ids == copying.token_ids == ar
    if policy != "lookup":  # lookup drafts only where nothing repeats, where a draft copies nothing
        assert copying.target_forwards != plain.target_forwards


def test_a_feature_draft_saves_and_loads_its_copy_weights(tmp_path):
    pair = tiny_feature_pair()
    save_feature_draft(pair.draft, tmp_path, {"hidden_size": 32, "vocab_size": 5})
    assert load_feature_draft(tmp_path, pair.target).copy_weights is None
    config = tmp_path / CONFIG_NAME
    config.write_text(json.dumps({**json.loads(config.read_text()), "copy_weights": [0.5] * MATCHES}))
    loaded = dataclasses.replace(pair, draft=load_feature_draft(tmp_path, pair.target))
    assert loaded.draft.copy_weights == [0.5] * MATCHES
    assert DraftSession(loaded.draft, [0, 1]).copy_weights == [0.5] * MATCHES
    for bad in ([0.5] * (MATCHES - 1), [1.0] * MATCHES, [-0.1] + [0.0] * (MATCHES - 1)):
        config.write_text(json.dumps({**json.loads(config.read_text()), "copy_weights": bad}))
        with pytest.raises(DyspecError, match="copy_weights must be 6 numbers in"):
            load_feature_draft(tmp_path, pair.target)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # through numpy; as on a GPU
def test_entries_are_read_and_written_in_place(dtype):
    t = torch.randn(3, 10, generator=torch.Generator().manual_seed(0)).to(dtype)
    at = [(0, 4), (2, 9), (1, 0)]
    assert entries.read(t, at) == [t[r, c].item() for r, c in at]
    entries.write(t, at, [1.5, -2.0, 3.25])
    assert [t[r, c].item() for r, c in at] == [1.5, -2.0, 3.25]
