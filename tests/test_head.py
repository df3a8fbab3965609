"""SpecDec++: the acceptance head, its training data and training, and the specdecpp policy."""

import itertools
import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from dyspec import figures, generate, stream
from dyspec.core.copying import MATCHES, mix_along
from dyspec.core.events import StepVerified
from dyspec.core.kv import KVSession
from dyspec.errors import DyspecError
from dyspec.load.head import SHIPPED, AcceptanceHead, auc, head_for, load_head, save_head
from dyspec.train.head import calibration, fit_calibration, head_examples, split_by_sequence, train_head

from .tiny import tiny_feature_pair, tiny_head_file, tiny_pair


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5, (n, 4), generator=g).tolist()


EVAL = random_prompts(3, seed=9)  # the tiny pair has no tokenizer for MT-Bench's text


def test_auc_matches_pairwise_count_with_soft_labels():
    g = torch.Generator().manual_seed(0)
    score = torch.randint(0, 5, (40,), generator=g).float()  # ties on purpose
    label = torch.rand(40, generator=g)
    num = den = 0.0
    for i, j in itertools.product(range(40), repeat=2):
        w = float(label[i] * (1 - label[j]))
        num += w * (1.0 if score[i] > score[j] else 0.5 if score[i] == score[j] else 0.0)
        den += w
    assert auc(score, label) == pytest.approx(num / den, rel=1e-9)
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_head_examples_hidden_states_and_labels(pair, temperature):
    """Each example's hidden state is the draft's at y on the real prefix, as a fresh forward of
    prefix + [y] gives it, and its label is min(1, p(y) / q(y))."""
    prompt, response = [0, 3, 1], [2, 2, 4, 1, 0, 3]
    g = torch.Generator().manual_seed(1)
    ex = head_examples(pair, prompt, response, temperature, g)
    assert ex["hidden"].shape == (len(response), 32) and ((ex["label"] >= 0) & (ex["label"] <= 1)).all()
    seq = prompt + response
    replaced = 0
    for i in range(len(response)):
        prefix = seq[: len(prompt) + i]
        q1 = torch.softmax(pair.draft(torch.tensor([prefix])).logits[0, -1], -1)
        y = int((q1 == ex["q"][i]).nonzero()[0])  # the drawn token: the one with the recorded q(y)
        replaced += y != response[i]
        kv = KVSession(pair.draft, keep_hidden=True)
        kv.forward(prefix + [y])
        assert torch.allclose(ex["hidden"][i], kv.hidden[-1], atol=1e-5)
        if temperature == 0:
            p = pair.target(torch.tensor([prefix])).logits[0, -1]
            assert ex["label"][i] == float(int(p.argmax()) == y)
    assert replaced > 0  # the branch path (y not the real token) was exercised


def test_head_examples_feed_a_feature_draft_the_targets_features():
    """A feature draft's hidden state at y is the one it has in the engine: each token reads the
    target's hidden state at the token before (y, at its parent), not zeros."""
    pair = tiny_feature_pair()
    prompt, response = [0, 3, 1], [2, 2, 4, 1, 0, 3]
    ex = head_examples(pair, prompt, response, 0.8, torch.Generator().manual_seed(1))
    seq = prompt + response
    replaced = 0
    for i in range(len(response)):
        prefix = seq[: len(prompt) + i]
        h = pair.target(torch.tensor([prefix]), output_hidden_states=True).hidden_states[-1][0]
        kv = KVSession(pair.draft, keep_hidden=True)
        q1 = torch.softmax(kv.forward(prefix, features=torch.cat([torch.zeros_like(h[:1]), h[:-1]]))[-1], -1)
        # y: the token whose probability head_examples recorded. Not by bitwise equality: it ran the
        # draft over the whole sequence, this over the prefix, and a CPU's kernels may round a
        # row differently for another length (seen on an AMD EPYC with AVX-512)
        gap = (q1 - ex["q"][i]).abs()
        y = int(gap.argmin())
        assert gap[y] < 1e-6 and (gap > 1e-4).sum() == len(gap) - 1
        replaced += y != response[i]
        kv.forward([y], features=h[-1:])
        assert torch.allclose(ex["hidden"][i], kv.hidden[-1], atol=1e-5)
    assert replaced > 0


def test_head_examples_of_a_copying_draft_read_its_mixture():
    """With copy weights, q(y) and y are the copying draft's (dyspec.core.copying), as in the engine."""
    pair = tiny_feature_pair()
    prompt, response = [0, 3, 1], [2, 0, 3, 1, 4, 0, 3]
    seq, n0 = prompt + response, len(prompt) - 1
    plain = head_examples(pair, prompt, response, 0.0, torch.Generator())
    weights = [0.6] * MATCHES
    pair.draft.copy_weights = weights
    copying = head_examples(pair, prompt, response, 0.0, torch.Generator())
    h = pair.target(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    raw = KVSession(pair.draft).forward(seq[:-1], features=torch.cat([torch.zeros_like(h[:1]), h[:-1]]))[n0:]
    q1 = torch.softmax(mix_along(raw, seq, n0, weights, 0.0), -1)
    torch.testing.assert_close(copying["q"], q1.max(-1).values)  # at T = 0, y is the mixture's argmax
    assert not torch.allclose(plain["q"], copying["q"])


def test_train_head_saves_a_loadable_head_and_resumes(pair, tmp_path):
    prompts = random_prompts(6)
    report = train_head(pair, tmp_path, prompts, max_new_tokens=6, epochs=2, heldout=0.34, eval_prompts=EVAL)
    assert report["examples"]["train"] > 0 and report["examples"]["heldout"] > 0
    assert 0 <= report["heldout"]["auc"]["head"] <= 1 and report["eval"]["prompts"] == len(EVAL)
    head, meta = load_head(str(tmp_path / "head.safetensors"))
    assert meta["draft"] == "tiny-draft" and head.hidden_size == 32
    assert len((tmp_path / "continuations.jsonl").read_text().splitlines()) == 6
    again = train_head(pair, tmp_path, prompts, max_new_tokens=6, epochs=3, heldout=0.34, eval_prompts=EVAL)
    assert json.loads((tmp_path / "report.json").read_text()) == again  # resumed: epoch 3 only, same data
    assert again["examples"] == report["examples"]


def test_head_training_learns(pair, tmp_path):
    """On data where acceptance depends on the hidden state, the held-out loss falls with training."""
    prompts = random_prompts(40, seed=1)
    untrained = train_head(pair, tmp_path, prompts, max_new_tokens=12, epochs=0, temperature=0.8, eval_prompts=EVAL)
    report = train_head(pair, tmp_path, prompts, max_new_tokens=12, epochs=30, temperature=0.8, eval_prompts=EVAL)
    assert report["examples"] == untrained["examples"]
    assert report["loss"]["heldout"] < untrained["loss"]["heldout"]


@pytest.mark.parametrize("design", ["dyspec", "specdecpp"])
def test_a_trained_head_is_calibrated_on_the_validation_examples(pair, tmp_path, design):
    """Platt scaling sets the intercept where the mean prediction equals the mean label (the
    gradient in b is their difference), on the validation examples it is fitted to, and the saved
    head predicts with it."""
    prompts = random_prompts(40, seed=1)
    report = train_head(pair, tmp_path, prompts, max_new_tokens=12, epochs=5, design=design, eval_prompts=EVAL)
    head, meta = load_head(str(tmp_path / "head.safetensors"))
    assert meta["design"] == report["design"] == design and head.design == design
    assert head.calibration.tolist() == pytest.approx(report["calibration"], abs=1e-4)
    data = load_file(tmp_path / "examples-T0.6.safetensors")
    _, val, _ = split_by_sequence(data["seq"], 0.1)
    assert val.any() and report["stamp"]["host"]  # stamped with the machine it was trained on
    predicted = head.accept_prob(data["hidden"][val], data["q"][val])
    assert float(predicted.mean()) == pytest.approx(float(data["label"][val].mean()), abs=1e-3)
    with pytest.raises(DyspecError, match="design"):  # a checkpoint of the other design is not resumed
        other = "dyspec" if design == "specdecpp" else "specdecpp"
        train_head(pair, tmp_path, prompts, max_new_tokens=12, epochs=6, design=other, eval_prompts=EVAL)


def test_fit_calibration_recovers_a_known_platt_map():
    """Labels drawn with chance sigmoid(2 z - 1) from a head whose logit is z: (a, b) = (2, -1)."""
    g = torch.Generator().manual_seed(0)
    head = AcceptanceHead(4, n_blocks=1)
    hidden, q = torch.randn(20000, 4, generator=g), torch.rand(20000, generator=g)
    z = head.logit(hidden, q).detach()
    label = torch.bernoulli(torch.sigmoid(2 * z - 1), generator=g)
    fit_calibration(head, hidden, q, label)
    assert head.calibration.tolist() == pytest.approx([2.0, -1.0], abs=0.1)
    torch.testing.assert_close(
        head.accept_prob(hidden, q), torch.sigmoid(head.calibration[0] * z + head.calibration[1])
    )


def test_calibration_bins_and_error_by_hand():
    predicted = torch.tensor([0.05, 0.15, 0.15, 0.95])
    label = torch.tensor([0.0, 1.0, 0.0, 0.5])
    table = calibration(predicted, label)
    assert [(r["bin"], r["examples"], r["observed"]) for r in table["bins"]] == [
        ([0.0, 0.1], 1, 0.0),
        ([0.1, 0.2], 2, 0.5),
        ([0.9, 1.0], 1, 0.5),
    ]
    assert table["error"] == pytest.approx((0.05 + 2 * 0.35 + 0.45) / 4, abs=1e-4)


def test_the_papers_head_design_reads_the_hidden_state_alone_through_one_shared_block(tmp_path):
    """SpecDec_pp's `[ResBlock(h)] * num_layers`: one block's weights applied n times; q never read.
    Saved and loaded with its design and calibration."""
    torch.manual_seed(0)
    head = AcceptanceHead(8, n_blocks=3, design="specdecpp")
    assert len(head.blocks) == 1 and head.blocks[0].weight.abs().sum() > 0  # default init, not the identity
    x = torch.randn(5, 8)
    expected = x
    for _ in range(3):
        expected = expected + torch.nn.functional.silu(head.blocks[0](expected))
    torch.testing.assert_close(head(x, torch.rand(5)), head.out(expected))
    torch.testing.assert_close(head(x, torch.rand(5)), head(x, torch.rand(5)))
    head.calibration.copy_(torch.tensor([0.0, -0.5]))
    save_head(head, tmp_path / "h.safetensors", {})
    loaded, meta = load_head(str(tmp_path / "h.safetensors"))
    assert (meta["design"], meta["n_blocks"], len(loaded.blocks)) == ("specdecpp", 3, 1)
    torch.testing.assert_close(loaded.accept_prob(x, torch.rand(5)), torch.sigmoid(torch.tensor(-0.5)).expand(5))
    with pytest.raises(DyspecError, match="head design must be"):
        AcceptanceHead(8, design="medusa")


def drafted(events) -> list[StepVerified]:
    """A generation's steps but the answer's last where its one token left is the target's own (a
    step of the root alone: dyspec.auto.controller.FixedBudget); every other step drafts."""
    steps = [e for e in events if isinstance(e, StepVerified)]
    assert all(len(s.tokens) > 1 for s in steps[:-1])
    return steps if len(steps[-1].tokens) > 1 else steps[:-1]


@pytest.mark.parametrize("bias,expected_k", [((9.0, -9.0), 2), ((-9.0, 9.0), 6)])
def test_specdecpp_stops_by_predicted_acceptance(pair, tmp_path, bias, expected_k):
    """A head sure of rejection stops at min_k; one sure of acceptance drafts up to max_k."""
    head = tiny_head_file(tmp_path / "head.safetensors", bias)
    events = stream(pair, [0, 3, 1], "specdecpp", 16, 0.0, max_new_tokens=20, options={"head": head, "max_k": 6})
    steps = drafted(events)
    assert {len(s.tokens) - 1 for s in steps} == {expected_k}
    for s in steps:
        predicted = s.extra["predicted_acceptance"]  # one per node; none for the last, never forwarded
        assert len(predicted) == expected_k and predicted[-1] is None and None not in predicted[:-1]
        assert all(p == pytest.approx(1.0 if bias[1] > 0 else 0.0, abs=1e-6) for p in predicted if p is not None)
    fig = figures.tree_figure(steps[0])  # the views show the prediction next to the outcome
    nodes = [t for t in fig.data if t.mode == "markers+text" and t.name != figures.LEGEND["target"]]  # drafted
    assert nodes and all("predicted acceptance" in t.hovertemplate for t in nodes)
    shown = {row[5] for t in nodes for row in t.customdata}
    assert shown >= {f"{p:.3f}" for p in steps[0].extra["predicted_acceptance"] if p is not None}


def test_specdecpp_greedy_matches_ar_with_any_head(pair, tmp_path):
    head = tiny_head_file(tmp_path / "head.safetensors")
    ar = generate(pair, [0, 3, 1], policy="ar", max_new_tokens=30).token_ids
    for h in (0.2, 0.5, 0.8):
        r = generate(pair, [0, 3, 1], policy="specdecpp", budget=8, max_new_tokens=30, options={"head": head, "h": h})
        assert r.token_ids == ar


def test_specdecpp_bad_options(pair, tmp_path):
    head = tiny_head_file(tmp_path / "head.safetensors")
    with pytest.raises(DyspecError, match="h must be"):
        generate(pair, [0, 1], policy="specdecpp", options={"head": head, "h": 1.5})
    with pytest.raises(DyspecError, match="min_k"):
        generate(pair, [0, 1], policy="specdecpp", options={"head": head, "min_k": 5, "max_k": 3})
    with pytest.raises(DyspecError, match="not found"):
        generate(pair, [0, 1], policy="specdecpp", options={"head": str(tmp_path / "nope.safetensors")})
    with pytest.raises(DyspecError, match="no acceptance head ships"):
        head_for(pair)


def test_dyspec_head_score_shapes_the_tree(pair, tmp_path):
    """score=head: a head sure of rejection makes every node's descendants nearly worthless, so the
    budget goes to the root's children; one sure of acceptance lets the tree grow deep. Nodes that
    were never forwarded have no prediction."""
    depth = {}
    for bias in [(9.0, -9.0), (-9.0, 9.0)]:
        head = tiny_head_file(tmp_path / f"head{bias[1]}.safetensors", bias)
        options = {"score": "head", "head": head, "batch": 1}
        events = stream(pair, [0, 3, 1], "dyspec", 4, 0.0, max_new_tokens=20, options=options)
        steps = drafted(events)
        depth[bias[1] > 0] = sum(max(s.depths) for s in steps) / len(steps)
        for s in steps:
            predicted = s.extra["predicted_acceptance"]
            assert len(predicted) == len(s.tokens) - 1 and None in predicted  # the leaves have none
            forwarded = [p for p in predicted if p is not None]
            assert all(p == pytest.approx(1.0 if bias[1] > 0 else 0.0, abs=1e-6) for p in forwarded)
        r = generate(pair, [0, 3, 1], policy="dyspec", budget=4, max_new_tokens=20, options=options)
        assert r.token_ids == generate(pair, [0, 3, 1], policy="ar", max_new_tokens=20).token_ids
    assert depth[False] < 1.5 and depth[True] > 3
    with pytest.raises(DyspecError, match="score must be"):
        generate(pair, [0, 1], policy="dyspec", options={"score": "nope"})
    with pytest.raises(DyspecError, match="no acceptance head ships"):
        generate(pair, [0, 1], policy="dyspec", options={"score": "head"})


def test_a_rewritten_head_file_is_read_again(tmp_path):
    path = tmp_path / "head.safetensors"
    tiny_head_file(path, (9.0, -9.0))
    assert load_head(str(path))[0].out.bias[0] == 9.0
    tiny_head_file(path, (-9.0, 9.0))
    os.utime(path, ns=(time.time_ns() + 10**9,) * 2)  # as written a second later (a coarse clock may not tell)
    assert load_head(str(path))[0].out.bias[0] == -9.0


@pytest.mark.parametrize("draft", ["distilled", "int8"])
def test_the_shipped_heads_are_calibrated_where_they_were_never_trained(draft):
    """Each shipped head's card: dyspec's design, a fitted calibration, and on MT-Bench (never
    trained on) a mean prediction and a calibration error within 0.05 of what happened."""
    head, meta = load_head(str(SHIPPED / f"smollm2-135m-instruct--{draft}.safetensors"))
    assert meta["design"] == "dyspec" and head.calibration.tolist() != [1.0, 0.0]
    scored = meta["eval"]
    assert scored["prompts"] == 80 and scored["calibration"]["error"] < 0.05
    assert abs(scored["mean_predicted"] - scored["acceptance_rate"]) < 0.05


def test_specdecpp_chains_lengthen_with_h_on_the_default_pair(default_pair):
    """The calibrated head adapts: a higher h (a rejection more likely before drafting stops) drafts
    longer chains on the same greedy answer, which stays the target's."""
    mean_k, texts = {}, set()
    for h in (0.3, 0.9):
        options = {"h": h, "min_k": 1}
        events = stream(
            default_pair, "List five fruits, one per line.", "specdecpp", 16, max_new_tokens=32, options=options
        )
        steps = [e for e in events if isinstance(e, StepVerified)]
        mean_k[h] = sum(len(s.tokens) - 1 for s in steps) / len(steps)
        texts.add(tuple(t for s in steps for t in s.emitted))
    assert mean_k[0.9] > mean_k[0.3] + 1 and len(texts) == 1
