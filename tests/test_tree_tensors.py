"""The step on the device (dyspec.core.tree_tensors, `dyspec.policies.dyspec.grow`, `device_step`): its
tensor programs against the host's node-by-node references on the same inputs, and the step's one
host read."""

import dataclasses
import random
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dyspec.auto.budget import AutoState
from dyspec.auto.controller import AutoBudget
from dyspec.auto.estimate import slot_keys
from dyspec.core.contract import BINS
from dyspec.core.copying import copy_token, copy_tokens, mix, mix_rows
from dyspec.core.tree import Tree
from dyspec.core.tree_tensors import add_nodes, new_tree, proposals, read_step, to_tree, verify_greedy
from dyspec.core.verify import verify_greedy as verify_greedy_host
from dyspec.decode.engine import generate
from dyspec.eval.anatomy import _on_steps, counting, step_counts
from dyspec.load.head import AcceptanceHead, save_head
from dyspec.policies import POLICIES, chain, dyspec, dyspec_threshold, eagle2, sequoia, sglang, specdecpp, specinfer
from dyspec.policies.common import expand_and_rerank, grow_and_rerank

from .conftest import PROMPTS
from .test_anatomy import site_of

WEIGHTS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]


def test_copies_on_the_device_are_the_hosts():
    rng = random.Random(0)
    weights = torch.tensor([0.0, *WEIGHTS], dtype=torch.float64)
    for _ in range(200):
        contexts = [[rng.randrange(3) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
        rows = torch.full((4, 32), -1)
        for i, c in enumerate(contexts):
            rows[i, : len(c)] = torch.tensor(c)
        tokens, w = copy_tokens(rows, torch.tensor([len(c) for c in contexts]), weights)
        assert [(int(x), float(y)) for x, y in zip(tokens, w)] == [copy_token(array("i", c), WEIGHTS) for c in contexts]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_mixing_on_the_device_is_the_hosts_to_the_bit(temperature):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    columns, weights = [3, 7, 0, 9], [0.3, 0.0, 0.5, 0.2]
    host = mix(logits, columns, weights, temperature)
    device = mix_rows(logits, torch.tensor(columns), torch.tensor(weights, dtype=torch.float64), temperature)
    assert torch.equal(host, device) and not torch.equal(host, logits.float())


def random_tree(rng: random.Random, n: int, vocab: int, padding: int) -> tuple[Tree, list[int]]:
    """A tree of n nodes with duplicate siblings, and `padding` invalid nodes after it, as tensors."""
    tree = Tree.root(0)
    for _ in range(n - 1):
        tree.add(rng.randrange(len(tree)), rng.randrange(vocab), 0.5)
    return tree, [rng.randrange(n) for _ in range(padding)]


def test_greedy_verification_on_the_device_is_the_walks():
    rng = random.Random(2)
    for trial in range(300):
        tree, padding = random_tree(rng, rng.randrange(1, 20), 3, rng.randrange(3))
        t = new_tree(0, len(tree) + len(padding), torch.device("cpu"), "deterministic", None)
        for node in range(1, len(tree)):
            parent = torch.tensor([tree.parents[node]])
            add_nodes(t, node, parent, torch.tensor([tree.tokens[node]]), torch.tensor([0.5]), torch.tensor([True]))
        if padding:  # padding matches the target everywhere, and must still never be accepted
            add_nodes(
                t,
                len(tree),
                torch.tensor(padding),
                torch.zeros(len(padding), dtype=torch.long),
                torch.ones(len(padding)),
                torch.zeros(len(padding), dtype=torch.bool),
            )
        argmax = torch.tensor([rng.randrange(3) for _ in range(len(t))])
        argmax[len(tree) :] = 0
        accepted, next_token = verify_greedy(t, argmax)
        host = verify_greedy_host(tree, argmax.tolist())
        assert ([i for i in range(len(t)) if accepted[i]], int(next_token)) == host, trial


class TableDraft:
    """A draft whose logits after a node depend on its token and depth alone, small integers so that
    many slot values tie exactly: both builds see the same distributions, and their tie-breaking
    shows."""

    def __init__(self, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randint(0, 4, (66, vocab, vocab), generator=g).float()
        self.vocab, self.kv = None, SimpleNamespace(device=torch.device("cpu"))
        self.compiled = False

    def vocab_columns(self, device: torch.device) -> tuple[None, int]:
        return None, 0

    def logits(self, tree: Tree, nodes: list[int], on_device: bool = False) -> torch.Tensor:
        return self.table[[tree.depths[n] for n in nodes], [tree.tokens[n] for n in nodes]]

    def tree_logits(self, t, nodes: list[int]) -> torch.Tensor:
        return self.table[t.depths[nodes].clamp(max=65), t.tokens[nodes]]


def grown_tree(t) -> Tree:
    """The views' `Tree` of a tree grown on the device, nothing accepted."""
    return to_tree(t, no_verdict(t))[0]


@pytest.mark.parametrize("batch, max_depth", [(None, 16), (1, 16), (3, 2), (7, 16), (1, 3)])
def test_the_tree_grown_on_the_device_is_the_heaps(batch, max_depth):
    """`grow` against `build` (Algorithm 1 with a heap) on the same draft outputs, at budgets 1-64 over
    many seeds: the same nodes in the same order, with the same probabilities and growth."""
    for seed in range(12):
        draft = TableDraft(12, seed)
        for budget in (1, 2, 5, 8, 16, 33, 64):
            options = dict(batch=batch, max_depth=max_depth, select="top")
            ref = dyspec.build(draft, 3, budget, 0.0, torch.Generator(), **options)
            t = dyspec.grow(draft, 3, budget, 0.0, torch.Generator(), dyspec.POLICY.options | options)
            tree = grown_tree(t)
            assert (tree.tokens, tree.parents, tree.draft_probs) == (ref.tokens, ref.parents, ref.draft_probs)
            assert tree.values == ref.values and tree.growth == ref.growth, (seed, budget)
            assert all(torch.equal(tree.q[n], ref.q[n]) for n in ref.q)
            # the device forwards a round's picks at max_depth too (one shape a round): their q is extra
            assert all(tree.depths[n] == max_depth for n in set(tree.q) - set(ref.q))


@pytest.mark.parametrize("temperature, batch", [(0.8, None), (0.8, 1), (0.0, 3)])
def test_the_heap_by_learnt_rates_on_the_device_is_the_hosts(temperature, batch):
    """Under `--budget auto` with drawn children the heap values a slot by the rate auto learnt for its
    bin (`LearntScore`), which need not fall with the slot's rank: random rates, so that a later
    slot often outranks an earlier one, and the device's picks pop as the heap does. The threshold
    build's layers by the same rates too, one node a layer, so that the draws match row for row."""
    for seed in range(10):
        draft = TableDraft(12, seed)
        g = lambda seed=seed: torch.Generator().manual_seed(seed)  # noqa: E731
        rates = torch.rand(2 * BINS, generator=g()).tolist()
        builds = [
            (dyspec, {"batch": batch, "select": "sample"}),
            (dyspec_threshold, {"width": 1, "select": "sample", "threshold": 0.05}),
        ]
        for policy, options in builds:
            for budget in (1, 4, 8, 16, 33):  # rounds without padding: the host's draws come row for row
                learnt = options | {"auto_rates": rates}
                ref = policy.build(draft, 3, budget, temperature, g(), **learnt)
                t = policy.grow(draft, 3, budget, temperature, g(), policy.POLICY.options | learnt)
                assert assert_same_tree(t, ref).growth == ref.growth, (policy, seed, budget)
            unlearnt = policy.build(draft, 3, budget, temperature, g(), **options)
            assert (unlearnt.tokens, unlearnt.parents) != (ref.tokens, ref.parents)  # the rates change the tree


@pytest.mark.parametrize("width, max_depth", [(None, 16), (2, 16), (None, 2), (1, 16), (5, 3)])
def test_the_threshold_tree_grown_on_the_device_is_the_layers(width, max_depth):
    """`dyspec_threshold.grow` against `build` (layer by layer, each node's children while their slots
    are worth more than t) at budgets 1-64 and several thresholds: the same nodes in the same order,
    probabilities, growth and every forwarded node's q."""
    for seed in range(12):
        draft = TableDraft(12, seed)
        for budget in (1, 2, 5, 8, 16, 33, 64):
            for threshold in (None, 0.02, 0.3):
                options = dict(width=width, max_depth=max_depth, select="top", threshold=threshold)
                ref = dyspec_threshold.build(draft, 3, budget, 0.0, torch.Generator(), **options)
                t = dyspec_threshold.grow(
                    draft, 3, budget, 0.0, torch.Generator(), POLICIES["dyspec-threshold"].options | options
                )
                tree = assert_same_tree(t, ref)
                assert tree.growth == ref.growth and len(t) == budget + 1, (
                    seed,
                    budget,
                    threshold,
                )  # cut to the budget
                for depth in range(max(ref.depths)) if width else ():  # at most `width` nodes of a layer have children
                    assert len({u for u in ref.parents[1:] if ref.depths[u] == depth}) <= width


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("merged", [1, 2, 3])
def test_the_static_k_ary_tree_grown_on_the_device_is_specinfers(temperature, merged):
    """`specinfer.grow` against `specinfer.build` with one draft and with merged ones: chosen children at
    T = 0, where a token another draft put under a node already is shared (small tables: often),
    and i.i.d. draws at T > 0 from the same generator in the same order, seed for seed, each drawn
    from its own draft's q."""
    for seed in range(8):
        drafts = [TableDraft(12, seed + 100 * d) for d in range(merged)]
        g = lambda seed=seed: torch.Generator().manual_seed(seed)  # noqa: E731
        for each, expansion in [(1, None), (6, None), (16, None), (6, "2,2"), (15, "3,1,2"), (20, "1,1,1")]:
            options, budget = POLICIES["specinfer"].options | {"expansion": expansion}, each * merged
            ref = specinfer.build(drafts, 3, budget, temperature, g(), expansion=expansion)
            tree = assert_same_tree(specinfer.grow(drafts, 3, budget, temperature, g(), options), ref)
            assert tree.growth == ref.growth and set(ref.q) <= set(tree.q) and (merged > 1 or set(tree.q) == set(ref.q))
            if temperature > 0:  # what verification reads: the q each node was drawn from
                assert all(torch.equal(tree.proposal(n), ref.proposal(n)) for n in range(1, len(ref)))


@pytest.mark.parametrize("confidence", [0.0, 0.2, 0.6])
def test_the_chain_grown_on_the_device_is_the_loops(confidence):
    """`chain.grow` against `chain.build`, the confidence stop included: the same tokens and growth,
    and the same probabilities but for the last bit (torch's float64 exp against the host's
    math.exp)."""
    for seed in range(12):
        draft = TableDraft(12, seed)
        for budget in (1, 2, 5, 16):
            ref = chain.build(draft, 3, budget, 0.0, torch.Generator(), confidence=confidence)
            t = chain.grow(draft, 3, budget, 0.0, torch.Generator(), chain.POLICY.options | {"confidence": confidence})
            tree = to_tree(
                t, read_step(t, torch.zeros(len(t), dtype=torch.bool), torch.tensor([0]), torch.zeros(len(t)))
            )[0]
            assert (tree.tokens, tree.parents, tree.growth) == (ref.tokens, ref.parents, ref.growth) and not tree.q
            assert tree.draft_probs == pytest.approx(ref.draft_probs, rel=1e-15)
            assert tree.values == pytest.approx(ref.values, rel=1e-14)


def assert_same_tree(t, ref: Tree) -> Tree:
    """The device's tree, as the views get it, is `ref`: nodes, probabilities, values, sampling and
    every forwarded node's q; returned for more checks."""
    tree = grown_tree(t)
    assert (tree.tokens, tree.parents, tree.draft_probs, tree.values) == (
        ref.tokens,
        ref.parents,
        ref.draft_probs,
        ref.values,
    )
    assert tree.sampling == ref.sampling and all(torch.equal(tree.q[n], ref.q[n]) for n in ref.q)
    return tree


def test_the_static_tree_grown_on_the_device_is_the_layers():
    """`sequoia.grow` against `sequoia.build` on random breadth-first shapes and the DP's optimal trees."""
    rng = random.Random(3)
    shapes = [sequoia.optimal_tree((0.6, 0.2, 0.1, 0.05), budget, 8)[0] for budget in (1, 4, 16, 40)]
    for _ in range(30):
        parents = [-1]
        for i in range(1, rng.randrange(2, 30)):
            parents.append(rng.randint(max(0, parents[-1]), i - 1))
        shapes.append(parents)
    for seed, parents in enumerate(shapes):
        draft = TableDraft(12, seed)
        ref = sequoia.build(draft, 3, len(parents) - 1, 0.0, torch.Generator(), parents=parents, select="top")
        options = sequoia.POLICY.options | {"parents": parents, "select": "top"}
        t = sequoia.grow(draft, 3, len(parents) - 1, 0.0, torch.Generator(), options)
        tree = assert_same_tree(t, ref)
        assert tree.growth == ref.growth and set(tree.q) == set(ref.q)
    with pytest.raises(Exception, match="breadth-first"):
        sequoia.grow(draft, 3, 3, 0.0, torch.Generator(), sequoia.POLICY.options | {"parents": [-1, 0, 1, 0]})


@pytest.mark.parametrize("temperature, select", [(0.0, "sample"), (0.8, "auto"), (0.8, "top")])
def test_drawn_children_grown_on_the_device_are_the_hosts(temperature, select):
    """At T > 0 (and with drawn children at T = 0) the device's builds draw from the same generator in
    the same order as the host's: `dyspec`, `chain` and `sequoia`, seed for seed, the same trees."""

    shape = sequoia.optimal_tree((0.6, 0.2, 0.1, 0.05), 12, 8)[0]
    for seed in range(10):
        draft = TableDraft(12, seed)
        g = lambda seed=seed: torch.Generator().manual_seed(seed)  # noqa: E731
        for budget in (1, 4, 8, 16, 33):
            options = {"select": select}
            assert_same_tree(
                dyspec.grow(draft, 3, budget, temperature, g(), dyspec.POLICY.options | options),
                dyspec.build(draft, 3, budget, temperature, g(), **options),
            )
        if temperature > 0:
            assert_same_tree(
                chain.grow(draft, 3, 6, temperature, g(), chain.POLICY.options),
                chain.build(draft, 3, 6, temperature, g()),
            )
        options = {"parents": shape, "select": select}
        assert_same_tree(
            sequoia.grow(draft, 3, 12, temperature, g(), sequoia.POLICY.options | options),
            sequoia.build(draft, 3, 12, temperature, g(), **options),
        )


@pytest.mark.parametrize("topk, steps", [(1, 1), (2, 3), (4, 5), (10, 3)])
def test_the_reranked_tree_grown_on_the_device_is_the_pools(topk, steps):
    """`grow_and_rerank` (eagle2's and sglang's tree) against `expand_and_rerank`: the frontiers chosen
    and the pool cut on the device, the same tree as the host's sorts make, ties and all."""
    for seed in range(10):
        for budget in (1, 3, 8, 20, 64):
            draft = RelabelledTable(12, seed)
            ref = expand_and_rerank(draft, 3, budget, topk, steps)
            t = grow_and_rerank(draft, 3, budget, topk, steps)
            tree = grown_tree(t)
            assert (tree.tokens, tree.parents, tree.draft_probs) == (ref.tokens, ref.parents, ref.draft_probs)
            assert tree.values == ref.values and tree.growth == ref.growth, (seed, budget)


class HiddenTable(TableDraft):
    """A `TableDraft` with hidden states for an acceptance head: its logits, as hidden states of the
    vocabulary's width."""

    def logits(self, tree, nodes, on_device=False):
        self.hidden = super().logits(tree, nodes)
        return self.hidden

    def tree_logits(self, t, nodes):
        self.hidden = super().tree_logits(t, nodes)
        return self.hidden


def random_head(tmp_path: Path, design: str) -> str:
    """A random head's file for `HiddenTable`'s hidden states: its predictions vary with them."""
    torch.manual_seed(0)
    head = AcceptanceHead(12, n_blocks=2, design=design)
    with torch.no_grad():
        head.out.weight.mul_(0.2)  # predictions spread across (0, 1), not all at 1
    path = str(tmp_path / "head.safetensors")
    save_head(head, Path(path), {})
    return path


@pytest.mark.parametrize("design", ["dyspec", "specdecpp"])
def test_the_heads_trees_grown_on_the_device_are_the_hosts(tmp_path, design):
    """specdecpp's chain (its stop as padding) and dyspec with score="head" (each node's reach the
    product of the head's predictions on its path) against their host builds, the predictions
    included: a random head, whose predictions vary with the hidden state, on the same draft."""
    path = random_head(tmp_path, design)
    lengths = set()
    for seed in range(10):
        draft = HiddenTable(12, seed)
        g = lambda seed=seed: torch.Generator().manual_seed(seed)  # noqa: E731
        for temperature, h, min_k in [(0.0, 0.5, 1), (0.0, 0.3, 2), (0.8, 0.6, 1)]:
            options = {"head": path, "h": h, "min_k": min_k, "max_k": 8}
            ref = specdecpp.build(draft, 3, 6, temperature, g(), **options)
            t = specdecpp.grow(draft, 3, 6, temperature, g(), specdecpp.POLICY.options | options)
            tree = assert_same_tree(t, ref) if temperature else to_tree(t, no_verdict(t))[0]
            assert (tree.tokens, tree.parents, tree.extra) == (ref.tokens, ref.parents, ref.extra)
            lengths.add(len(tree))
        for budget, batch, max_depth in [(8, None, 16), (16, 3, 2), (33, 1, 16)]:
            options = {"score": "head", "head": path, "batch": batch, "max_depth": max_depth, "select": "top"}
            ref = dyspec.build(draft, 3, budget, 0.0, g(), **options)
            t = dyspec.grow(draft, 3, budget, 0.0, g(), dyspec.POLICY.options | options)
            tree = assert_same_tree(t, ref)
            assert tree.growth == ref.growth
            predicted, expected = tree.extra["predicted_acceptance"], ref.extra["predicted_acceptance"]
            assert [p is None for p in predicted] == [p is None for p in expected]
            if max_depth == 16:  # the same rows through the head: the same floats
                assert predicted == expected
            else:  # the device's head also reads the picks at max_depth, and a batch of more rows rounds differently
                assert [p for p in predicted if p] == pytest.approx([p for p in expected if p], rel=1e-6)
    assert len(lengths) > 1  # the head stopped chains at different lengths


def no_verdict(t):
    none = torch.zeros(len(t), dtype=torch.bool)
    return read_step(t, none, torch.tensor([0]), torch.zeros(len(t)))


class RelabelledTable(TableDraft):
    """A `TableDraft` that a rerank may renumber (`DraftSession.relabel`)."""

    def relabel(self, old_ids: list[int]) -> None:
        pass


def test_which_steps_run_on_the_device():
    def asks(policy, temperature: float, **options) -> bool:  # every option, the defaults filled in
        return policy.POLICY.on_device(temperature, policy.POLICY.options | options)

    assert not asks(dyspec, 0.0) and asks(dyspec, 0.0, step="device")  # the host by default
    assert not asks(chain, 0.0) and asks(chain, 0.0, step="device") and asks(chain, 0.7, step="device")
    assert asks(eagle2, 0.0, step="device") and asks(sglang, 0.7, step="device")
    assert asks(sequoia, 0.0, step="device") and asks(sequoia, 0.0, step="device", select="sample")
    for temperature, options in [(0.8, {}), (0.0, {"select": "sample"}), (0.8, {"select": "top"})]:
        assert asks(dyspec, temperature, step="device", **options)
    for temperature in (0.0, 0.8):
        assert asks(dyspec, temperature, step="device", score="head") and asks(specdecpp, temperature, step="device")
    assert not asks(specdecpp, 0.0)
    assert asks(dyspec_threshold, 0.8, step="device") and not asks(dyspec_threshold, 0.0)
    assert asks(specinfer, 0.8, step="device") and not asks(specinfer, 0.8)
    with pytest.raises(Exception, match="width must be at least 1"):
        dyspec_threshold.grow(TableDraft(4, 0), 3, 4, 0.0, None, POLICIES["dyspec-threshold"].options | {"width": 0})
    with pytest.raises(Exception, match="step must be one of host, device"):
        asks(dyspec, 0.0, step="gpu")


@pytest.mark.parametrize(
    "policy, budget, options, same_rows",
    [
        ("dyspec", 4, {}, True),
        ("dyspec", 16, {}, True),
        ("dyspec", 64, {}, True),
        ("dyspec", 10, {"batch": 3, "max_depth": 2}, False),
        ("chain", 4, {}, True),
        ("chain", 6, {"confidence": 0.5}, False),
        ("sequoia", 16, {}, True),
        ("sglang", 15, {"topk": 4, "steps": 3}, True),
        ("eagle2", 16, {}, True),
        ("specinfer", 15, {"expansion": "3,2,1"}, True),
        ("dyspec-threshold", 16, {}, False),  # forwarded in full layers of padding
        ("dyspec-threshold", 16, {"width": 4, "max_depth": 5}, False),
        ("specdecpp", 8, {"min_k": 1}, False),  # the head shipped for the pair; forwarded past its stop
        ("dyspec", 16, {"score": "head"}, True),
    ],
)
def test_a_step_on_the_device_is_the_host_step(pair, policy, budget, options, same_rows):
    """`ar`'s tokens (greedy identity) on the default pair, and where both steps forward the same rows
    (no padding, no pick at max_depth), the same trees step for step. The device's forwards carry
    its padding rows, and a forward of more rows rounds differently in fp32: the target's
    probabilities agree to that rounding."""
    trees = {}
    for step in ("host", "device"):
        seen = []
        hook = _on_steps(lambda e: seen.append((e.tokens, e.parents, e.accepted, e.target_probs)))  # noqa: B023
        out = generate(
            pair,
            PROMPTS[2],
            policy=policy,
            budget=budget,
            max_new_tokens=32,
            options=options | {"step": step},
            hooks=[hook],
        )
        trees[step] = seen, out.token_ids
    ar = generate(pair, PROMPTS[2], policy="ar", budget=1, max_new_tokens=32)
    assert trees["device"][1] == trees["host"][1] == ar.token_ids
    for host, device in zip(*(trees[s][0] for s in ("host", "device")), strict=True) if same_rows else ():
        assert host[:3] == device[:3]
        assert device[3] == pytest.approx(host[3], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize(
    "policy, budget",
    [
        ("dyspec", 4),
        ("dyspec", 64),
        ("chain", 4),
        ("sequoia", 16),
        ("sglang", 16),
        ("eagle2", 16),
        ("specdecpp", 8),
        ("dyspec-threshold", 8),
        ("specinfer", 8),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_step_on_the_device_reads_the_host_once(pair, policy, budget, temperature):
    options = {"step": "device"}
    counts = step_counts(pair, PROMPTS[1], policy, budget, max_new_tokens=24, options=options, temperature=temperature)
    assert counts["steps"] > 3 and counts["reads"] == 1
    read = site_of("dyspec/core/tree_tensors.py", "packed(per_node, ids, compiled=compiled).tolist()")
    assert list(counts["read_sites"]) == [read]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_merged_drafts_step_on_the_device_reading_the_host_once(pair, temperature):
    """Two drafts (the same model twice: at T = 0 every node of the second is shared, padding) grow
    one tree on the device, read with the step's verdict."""
    two = dataclasses.replace(pair, extra_drafts=[pair.draft])
    counts = step_counts(
        two, PROMPTS[1], "specinfer", 8, max_new_tokens=16, options={"step": "device"}, temperature=temperature
    )
    assert counts["steps"] > 3 and counts["reads"] == 1


def test_the_first_of_two_drafts_alone_steps_on_the_device(pair):
    """`n_drafts=1` with two loaded: the first draft's tree alone, `ar`'s tokens."""
    two = dataclasses.replace(pair, extra_drafts=[pair.draft])
    options = {"step": "device", "n_drafts": 1}
    one = generate(two, PROMPTS[0], policy="specinfer", budget=8, max_new_tokens=8, options=options)
    assert one.token_ids == generate(pair, PROMPTS[0], policy="ar", budget=1, max_new_tokens=8).token_ids


@pytest.mark.parametrize("policy", ["chain", "sequoia", "eagle2", "dyspec"])
def test_budget_auto_prices_a_tree_on_the_device_as_the_hosts(pair, monkeypatch, policy):
    """`--budget auto` with the step on the device: its first tree (both start at the same cap, T = 0)
    comes to the budget as the host's does, the same nodes priced by the same draft forwards in
    the host's numbering (a tree on the device counts its nodes with room for padding), and
    whole: the target verified every node built, so a cut would save nothing."""
    first = {}
    cut = AutoBudget.cut

    def spy(self, plan, tree, drafts, whole=False):
        calls = [c for d in drafts for c in d.calls]
        first.setdefault(whole, (tree.tokens, tree.parents, calls))
        return cut(self, plan, tree, drafts, whole)

    monkeypatch.setattr(AutoBudget, "cut", spy)
    for step in ("host", "device"):
        generate(pair, PROMPTS[2], policy=policy, budget="auto", max_new_tokens=24, options={"step": step})
    assert first[True] == first[False] and len(first[True][0]) > 2


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_budget_auto_steps_on_the_device_read_once_and_learn(pair, monkeypatch, temperature):
    """Each tree is built up to the cap `auto` planned, verified whole, and learnt from, with the step's
    one read: `ar`'s tokens at T = 0, and at T > 0 drawn children keyed by their proposals'
    agreement read with the tree (`Tree.agreement`), no q read."""
    plans, sizes = [], []
    plan, cut = AutoBudget.plan, AutoBudget.cut

    def planned(*args):
        plans.append(plan(*args))
        return plans[-1]

    def cut_whole(self, p, tree, drafts, whole=False):
        sizes.append(tree.size if whole else None)
        return cut(self, p, tree, drafts, whole)

    monkeypatch.setattr(AutoBudget, "plan", planned)
    monkeypatch.setattr(AutoBudget, "cut", cut_whole)
    state = AutoState()
    options = {"step": "device"}
    out = generate(
        pair,
        PROMPTS[0],
        policy="dyspec",
        budget="auto",
        temperature=temperature,
        max_new_tokens=24,
        options=options,
        auto_state=state,
    )
    assert sum(state.acceptance.reached) > 0 and len(set(sizes)) > 1
    # every step that drafted ran on the device (cut whole), within its cap
    assert all(size <= cap for size, cap in zip(sizes, (p.cap for p in plans), strict=True) if cap is not None)
    if temperature == 0:
        assert out.token_ids == generate(pair, PROMPTS[0], policy="ar", budget=1, max_new_tokens=24).token_ids
    counts = step_counts(pair, PROMPTS[0], "chain", "auto", 24, temperature=temperature, options=options)
    assert counts["steps"] > 3 and counts["reads"] == 1


def test_a_sampled_tree_read_from_the_device_brings_its_slot_keys():
    """`--budget auto` keys a drawn node by how often its proposal agrees with itself (the sum of q^2);
    a tree read from the device brings those sums (`proposals`, read with the step), so keying it
    reads no q, and its keys are those of the q rows themselves."""
    for seed in range(6):
        draft = TableDraft(12, seed)
        g = torch.Generator().manual_seed(seed)
        for t in (
            dyspec.grow(draft, 3, 16, 0.8, g, dyspec.POLICY.options),
            chain.grow(draft, 3, 6, 0.8, g, chain.POLICY.options),
        ):
            none = torch.zeros(len(t), dtype=torch.bool)
            host = read_step(t, none, torch.tensor([0]), torch.zeros(len(t)), q_square=proposals(t, 12)[1])
            tree = to_tree(t, host)[0]
            ref = dataclasses.replace(tree, agreement={})
            with counting() as count:
                keys = slot_keys(tree)
            assert count.reads == 0 and len(tree.agreement) == tree.size > 1
            assert keys == pytest.approx(slot_keys(ref), rel=1e-6)
