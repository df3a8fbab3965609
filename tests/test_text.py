"""Text of tokens that split a character: trees show the bytes, the streamed text never garbles."""

import re

import pytest

from dyspec import generate
from dyspec.decode.text import PARTIAL, stream_texts, token_labels
from dyspec.load.loading import DEFAULT_TARGET, load_tokenizer

TEXT = "你好，世界！Speculative decoding 很快 🚀 ça"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_TARGET)


@pytest.fixture(scope="module")
def ids(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert any(PARTIAL in t for t in tokenizer.batch_decode([[i] for i in ids]))  # it does split characters
    return ids


def test_a_character_split_over_tokens_streams_whole_wherever_the_steps_cut(tokenizer, ids):
    for cut in range(len(ids) + 1):
        first, pending = stream_texts(tokenizer, ids[:cut], [])
        second, pending = stream_texts(tokenizer, ids[cut:], pending)
        assert "".join(first + second) == TEXT and pending == []
        assert not any(PARTIAL in t for t in first + second)


def test_a_tree_labels_a_partial_character_by_its_bytes(tokenizer, ids):
    singles = tokenizer.batch_decode([[i] for i in ids])
    labels = token_labels(tokenizer, ids)
    rebuilt = b""
    for label, single in zip(labels, singles):
        if PARTIAL in single:
            assert re.fullmatch(r"<[0-9a-f]{2}( [0-9a-f]{2})*>", label), label
            rebuilt += bytes.fromhex(label[1:-1])
        else:
            assert label == single
            rebuilt += single.encode()
    assert rebuilt.decode() == TEXT


def test_labels_are_decoded_once_per_token_and_tokenizer(tokenizer, ids, monkeypatch):
    """A step's tree labels its tokens from what earlier steps decoded: the same labels, and only
    tokens not seen before reach the tokenizer."""
    first = token_labels(tokenizer, ids)
    asked = []
    decode = type(tokenizer).batch_decode
    monkeypatch.setattr(
        type(tokenizer), "batch_decode", lambda self, seqs, **kw: asked.append(seqs) or decode(self, seqs)
    )
    new = max(tokenizer.get_vocab().values())  # the vocabulary's last token: in no earlier test's text
    assert token_labels(tokenizer, [*ids, new, new]) == [*first, *tokenizer.batch_decode([[new]]) * 2]
    assert asked[0] == [[new]]


def test_a_chinese_answer_streams_without_replacement_characters(default_pair):
    steps = []
    finished = generate(
        default_pair, "Repeat exactly: 你好，世界！春天来了。", max_new_tokens=32, hooks=[lambda e: steps.append(e)]
    )
    verified = [e for e in steps if type(e).__name__ == "StepVerified"]
    special = set(default_pair.tokenizer.all_special_ids)
    streamed = "".join(t for s in verified for i, t in zip(s.emitted, s.emitted_texts) if i not in special)
    assert not any(PARTIAL in t for s in verified for t in s.emitted_texts)
    assert streamed == finished.text and re.search(r"[\u4e00-\u9fff]", streamed)


def test_a_deep_tree_keeps_its_depth_axis_readable():
    """A chain of 256 nodes gets a tick every few depths, not 257 ticks printed over each other, and
    one rejected early opens on the depths the verifier reached."""
    from dyspec.figures import ROOM_COLUMNS, TICKS, tree_figure

    from .test_speedup import fake_step  # a chain of `size` nodes, `emitted` - 1 accepted

    deep = tree_figure(fake_step(200, 257, 256, 0.0)).layout.xaxis  # accepted far: most of it on screen
    assert deep.range[1] > 200 and TICKS - 2 <= (deep.range[1] + 0.5) / deep.dtick <= TICKS + 1
    early = tree_figure(fake_step(3, 257, 256, 0.0)).layout.xaxis
    assert early.range[1] < ROOM_COLUMNS and (early.range[1] + 0.5) / early.dtick <= TICKS + 1
    assert tree_figure(fake_step(3, 5, 4, 0.0)).layout.xaxis.dtick == 1


def test_acceptance_by_depth_counts_the_steps_that_reached_each_depth():
    """A chain accepted to depth 2 of 3, a root with two rejected children, and a step that drafted
    nothing (it reaches no depth)."""
    from types import SimpleNamespace

    from dyspec.figures import depth_counts, depth_figure

    steps = [
        SimpleNamespace(parents=[-1, 0, 1, 2], accepted=[1, 2]),
        SimpleNamespace(parents=[-1, 0, 0], accepted=[]),
        SimpleNamespace(parents=[-1], accepted=[]),
    ]
    assert depth_counts(steps) == ([2, 1, 1], [1, 1, 0])
    bars = depth_figure(*depth_counts(steps)).data[0]
    assert list(bars.y) == [0.5, 1.0, 0.0] and list(bars.text) == ["1 of 2", "1 of 1", "0 of 1"]
