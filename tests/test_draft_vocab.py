"""Choosing a draft's vocabulary (dyspec.train.vocab): which tokens, and how many by measurement."""

import dataclasses
import json

import pytest
import torch

from dyspec import generate
from dyspec.drafts.feature import CONFIG_NAME, load_feature_draft, save_feature_draft
from dyspec.errors import DyspecError
from dyspec.train.vocab import candidate_sizes, choose_draft_vocab, choose_vocab, ranked, write_subset

from .tiny import tiny_feature_pair

PROMPTS = [[0, 3, 1, 2], [1, 1, 4], [2, 0, 3, 3], [4, 2, 1], [3, 0, 0, 1, 2], [0, 4, 4, 2], [2, 2, 3, 1]]


def test_the_draft_vocabulary_keeps_the_stop_and_special_tokens():
    """The most frequent tokens, and the answer's end however rare it is in the training text."""
    seqs = [(torch.tensor([5, 5, 5, 6, 6, 7, 7, 3]), None)]
    assert choose_vocab(seqs, 3, 10).tolist() == [5, 6, 7]
    assert choose_vocab(seqs, 3, 10, always={1, 3}).tolist() == [1, 3, 5]


def test_tokens_rank_by_count_the_kept_ones_first_and_ties_in_id_order():
    counts = torch.tensor([0, 4, 0, 9, 4, 1, 0, 0])
    assert ranked(counts, torch.tensor([6, 5, 4, 3, 2, 1])).tolist() == [3, 1, 4, 5, 2, 6]
    assert ranked(counts, torch.tensor([6, 5, 4, 3, 2, 1]), always={6}).tolist() == [6, 3, 1, 4, 5, 2]


def test_candidate_sizes_halve_the_drafts_own_down_to_512():
    assert candidate_sizes(8192) == [8192, 4096, 2048, 1024, 512]
    assert candidate_sizes(1100) == [1100, 550] and candidate_sizes(1000) == [1000] and candidate_sizes(4) == [4]


@pytest.fixture
def draft_folder(tmp_path):
    pair = tiny_feature_pair()
    save_feature_draft(pair.draft, tmp_path / "draft", {"hidden_size": 32, "vocab_size": 5, "copy_weights": None})
    return pair, tmp_path / "draft"


def loaded(pair, folders):
    """The tiny target with the drafts in `folders`, as `load_pair` gives several."""
    drafts = [load_feature_draft(folder, pair.target) for folder in folders]
    names = list(map(str, folders))
    return dataclasses.replace(
        pair, draft=drafts[0], draft_name=names[0], extra_drafts=drafts[1:], extra_draft_names=names[1:]
    )


def test_a_smaller_vocabulary_is_a_subset_of_the_drafts_and_stays_exact(draft_folder, tmp_path):
    pair, folder = draft_folder
    small = write_subset(folder, tmp_path / "small", torch.tensor([4, 1]), {"trimmed_from": {"draft_vocab": 4}})
    config = json.loads((small / CONFIG_NAME).read_text())
    assert config["draft_vocab"] == 2 and config["trimmed_from"] == {"draft_vocab": 4}
    trimmed = loaded(pair, [small])
    assert trimmed.draft.vocab.tolist() == [1, 4]
    for policy, budget, temperature in (("chain", 3, 0.0), ("dyspec", 6, 0.0)):
        ar = generate(pair, PROMPTS[0], policy="ar", max_new_tokens=12, temperature=temperature)
        got = generate(trimmed, PROMPTS[0], policy=policy, budget=budget, max_new_tokens=12, temperature=temperature)
        assert got.token_ids == ar.token_ids
    with pytest.raises(DyspecError, match="subset of its own"):
        write_subset(folder, tmp_path / "wrong", torch.tensor([3, 1]))  # 3 is outside the draft's [0, 1, 2, 4]


def test_each_size_is_measured_and_the_fastest_kept(draft_folder, tmp_path):
    pair, folder = draft_folder
    out = tmp_path / "out"
    report = choose_draft_vocab(
        pair, folder, out, lambda folders: loaded(pair, folders), [2, 4], prompts=PROMPTS, max_new_tokens=10,
        setting=("chain", 2, {}),
    )  # fmt: skip
    rows = report["candidates"]
    assert [row["draft_vocab"] for row in rows] == [4, 2]
    assert report["best"] == max(rows, key=lambda row: row["modelled_speedup"])
    assert report["prompts"] == {"ranked_on": 6, "replayed_on": 1, "max_new_tokens": 10}
    # the two tokens the target answers with most often on the six prompts it was ranked on
    counts = torch.bincount(
        torch.tensor([t for p in PROMPTS[:6] for t in generate(pair, p, max_new_tokens=10).token_ids]), minlength=5
    )
    top = sorted([0, 1, 2, 4], key=lambda t: (-int(counts[t]), t))[:2]
    assert load_feature_draft(out / "vocab-2", pair.target).vocab.tolist() == sorted(top)
    for row in rows:
        assert 1 <= row["tokens_per_forward"] <= 3 and 0 < row["draft_forwards_per_step"] <= 2
        assert row["draft_ms"][1] > 0 and row["modelled_speedup"] > 0
    card = json.loads((out / f"vocab-{report['best']['draft_vocab']}" / CONFIG_NAME).read_text())
    assert card["vocab_choice"]["setting"] == "chain at budget 2" and set(card["vocab_choice"]["candidates"]) == {
        "4",
        "2",
    }
    assert json.loads((out / "report.json").read_text())["best"]["draft_vocab"] == report["best"]["draft_vocab"]


def test_sizes_and_prompts_are_checked(draft_folder, tmp_path):
    pair, folder = draft_folder
    with pytest.raises(DyspecError, match="between 1 and the draft's own 4"):
        choose_draft_vocab(pair, folder, tmp_path, lambda f: pair, [8], prompts=PROMPTS)
    with pytest.raises(DyspecError, match="at least 5 prompts"):
        choose_draft_vocab(pair, folder, tmp_path, lambda f: pair, [2], num_prompts=3)
