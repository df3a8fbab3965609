"""A draft's reduced vocabulary (dyspec.core.vocab): the map between its columns and the target's
tokens, and trees over its columns that are the trees its widened distributions give."""

import dataclasses

import pytest
import torch

from dyspec import generate
from dyspec.core.copying import MATCHES
from dyspec.core.events import StepVerified
from dyspec.core.vocab import DraftVocab
from dyspec.decode import engine
from dyspec.errors import DyspecError

from .tiny import tiny_feature_pair, tiny_model

PROMPT = [0, 3, 1, 2, 0, 3, 1, 4, 0]


def test_the_map_between_columns_and_tokens():
    vocab = DraftVocab.of(torch.tensor([4, 0, 2]), 6)
    assert vocab.size == 6 and vocab.column_of == [1, -1, 2, -1, 0, -1]
    assert vocab.tokens(torch.tensor([[0, 2], [1, 1]]), 3).tolist() == [[4, 2], [0, 0]]
    assert vocab.tokens(torch.tensor([5, 3]), 6).tolist() == [5, 3]  # a full-width call's columns are tokens
    assert [vocab.column(t, 3) for t in range(6)] == [1, -1, 2, -1, 0, -1]
    assert vocab.column(3, 6) == 3
    assert [vocab.token(c, 3) for c in range(3)] == [4, 0, 2] and vocab.token(5, 6) == 5
    q = torch.tensor([[0.5, 0.25, 0.125]])
    assert vocab.widen(q).tolist() == [[0.25, 0.0, 0.125, 0.0, 0.5, 0.0]]
    assert vocab.widen(q, float("-inf"))[0, 1] == float("-inf")
    wide = torch.rand(2, 6)
    assert vocab.widen(wide) is wide
    assert DraftVocab.of(torch.arange(6), 6) is None  # every token in order: nothing to map


@pytest.mark.parametrize("ids", [[0, 0, 1], [0, 6], [-1, 2], list(range(6))[::-1]])
def test_a_bad_vocabulary_is_refused(ids):
    with pytest.raises(DyspecError, match="draft vocabulary"):
        DraftVocab.of(torch.tensor(ids), 6)


def full_width(monkeypatch):
    """Make the engine's drafts return logits over the target's whole vocabulary (-inf outside
    their own), as before drafts had columns."""
    open_drafts = engine.open_drafts

    def wide(*args):
        drafts = open_drafts(*args)
        for d in drafts:
            if d.kv is not None:
                d.kv.draft_vocab, d.vocab = False, None
        return drafts

    monkeypatch.setattr(engine, "open_drafts", wide)


def trees(pair, policy: str, budget: int, options: dict) -> tuple[list, list[int]]:
    steps = []
    r = generate(pair, PROMPT, policy=policy, budget=budget, max_new_tokens=24, options=options, hooks=[steps.append])
    return [(e.tokens, e.parents, e.accepted) for e in steps if isinstance(e, StepVerified)], r.token_ids


@pytest.mark.parametrize("copying", [False, True])
@pytest.mark.parametrize(
    "policy,budget,options",
    [
        ("chain", 3, {}),
        ("dyspec", 6, {}),
        ("dyspec-threshold", 6, {}),
        ("sequoia", 5, {"acceptance": [0.6, 0.2, 0.1]}),
        ("eagle2", 5, {"topk": 2, "depth": 3}),
        ("specinfer", 4, {"expansion": "2,1"}),
    ],
    ids=lambda x: str(x),
)
def test_trees_over_the_drafts_columns_are_the_trees_of_its_full_width_logits(
    monkeypatch, policy, budget, options, copying
):
    """At T = 0 the columns change no tree: ranking, values and copies (some outside the draft's 4
    tokens of 5, which widen their call) are those of the -inf-padded logits."""
    pair = tiny_feature_pair()
    pair.draft.copy_weights = [0.6] * MATCHES if copying else None
    columns, ids = trees(pair, policy, budget, options)
    full_width(monkeypatch)
    wide, wide_ids = trees(pair, policy, budget, options)
    assert columns == wide and ids == wide_ids
    assert sum(len(t[0]) - 1 for t in columns) > len(columns)  # trees were drafted


def test_merged_drafts_of_different_vocabularies_share_one_tree():
    """specinfer over a draft of 4 columns and one of the whole vocabulary: q's span the target's."""
    pair = dataclasses.replace(tiny_feature_pair(), extra_drafts=[tiny_model(2)], extra_draft_names=["tiny-draft"])
    ar = generate(pair, PROMPT, policy="ar", max_new_tokens=24).token_ids
    r = generate(pair, PROMPT, policy="specinfer", budget=8, max_new_tokens=24, options={"expansion": "2,1"})
    assert r.token_ids == ar and r.draft_forwards > 0
