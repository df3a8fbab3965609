"""Tree builders against brute force, on a deterministic synthetic draft (no model needed)."""

import itertools
import zlib
from functools import cache

import pytest
import torch

from dyspec.core.contract import BINS, AutoNeeds
from dyspec.core.sampling import ranked_children
from dyspec.core.tree import Tree
from dyspec.errors import DyspecError
from dyspec.policies import chain, dyspec, dyspec_threshold, eagle2, lookup, sglang, specdecpp, specinfer, suffix
from dyspec.policies.sequoia import optimal_tree, tree_score

V = 4


class SyntheticDraft:
    """Fixed next-token logits for every path: a deterministic function of the path's tokens (and
    of `salt`, which makes another draft), over the whole vocabulary."""

    vocab = None

    def __init__(self, salt: int = 0):
        self.forwards, self.salt, self.seen = 0, salt, []

    def logits(self, tree: Tree, nodes: list[int]) -> torch.Tensor:
        self.forwards += 1
        self.seen += nodes
        return torch.stack([path_logits(tuple(tree.tokens[i] for i in [0, *tree.path(n)]), self.salt) for n in nodes])

    def relabel(self, old_ids):
        pass


@cache
def path_logits(path: tuple[int, ...], salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((path, salt) if salt else path) % 2**31)
    return torch.randn(V, generator=g) * 2


def q_of(path: tuple[int, ...], tau: float, salt: int = 0) -> torch.Tensor:
    return torch.softmax(path_logits(path, salt) / tau, -1)


def best_subtree_value(budget: int, tau: float) -> float:
    """Brute force: the connected subtree (containing the root) of `budget` drafted nodes with the
    largest total path value, over all trees of that size."""
    best = 0.0

    def grow(chosen: frozenset, frontier: list, total: float):
        nonlocal best
        if len(chosen) == budget:
            best = max(best, total)
            return
        for i, (path, value) in enumerate(frontier):
            q = q_of(path, tau)
            kids = [(path + (y,), value * float(q[y])) for y in range(V)]
            # include frontier[i]; frontier entries before i are excluded for good (no duplicate sets)
            grow(chosen | {path}, frontier[i + 1 :] + kids, total + value)

    q = q_of((0,), tau)
    grow(frozenset(), [((0, y), float(q[y])) for y in range(V)], 0.0)
    return best


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5])
def test_dyspec_greedy_finds_the_best_subtree(budget):
    tree = dyspec.build(SyntheticDraft(), 0, budget, 0.0, torch.Generator(), batch=1, select="top")
    assert tree.size == budget
    assert sum(tree.values[1:]) == pytest.approx(best_subtree_value(budget, 0.6), rel=1e-6)


def test_dyspec_batches_draft_forwards():
    """16 nodes a forward, and no more forwards than `forwards_for` says: the root's round, short of
    slots (it has only V children), is not made up by a fifth forward."""
    draft = SyntheticDraft()
    tree = dyspec.build(draft, 0, 64, 0.0, torch.Generator(), batch=16, select="top")
    assert draft.forwards == dyspec.forwards_for(64, {"batch": 16}) == 4
    assert tree.size == V + 3 * 16 and tree.growth == [1 + V + 16 * i for i in range(4)]


@pytest.mark.parametrize("budget,options", [(4, {}), (9, {}), (16, {}), (5, {"batch": 1}), (30, {"batch": 4})])
def test_dyspec_forwards_for_counts_the_draft_forwards(budget, options):
    """`--budget auto` prices a DySpec tree of any size by `forwards_for`: 4 forwards at the default
    batch (budgets up to 16 here: a root has only V = 4 children to pop)."""
    draft = SyntheticDraft()
    tree = dyspec.build(draft, 0, budget, 0.0, torch.Generator(), select="top", **options)
    assert tree.size == budget and draft.forwards == dyspec.forwards_for(budget, options)


def test_dyspec_sampling_draws_siblings_without_replacement():
    g = torch.Generator().manual_seed(0)
    tree = dyspec.build(SyntheticDraft(), 0, 32, 0.7, g)
    assert tree.sampling == "without_replacement"
    for u in range(len(tree)):
        kids = [tree.tokens[c] for c in tree.children(u)]
        assert len(kids) == len(set(kids))


@pytest.mark.parametrize("first,later,kids", [(0.9, 0.01, [1] * V + [0]), (0.01, 0.9, [V] + [0] * V)])
def test_dyspec_under_auto_grows_what_the_learnt_rates_value(first, later, kids):
    """With `auto_rates` (sampled children), a slot is worth its parent's chance times its bin's
    learnt rate: first children worth 0.9 and later siblings 0.01 grow a chain, the reverse a root
    with all V children."""
    rates = [first] * BINS + [later] * BINS
    tree = dyspec.build(SyntheticDraft(), 0, V, 0.7, torch.Generator().manual_seed(0), batch=1, auto_rates=rates)
    assert [len(tree.children(u)) for u in range(len(tree))] == kids


@pytest.mark.parametrize(
    "first,later,budget,kids",
    [(0.9, 0.01, 16, [1] * 6 + [0]), (0.6, 0.9, V, [V] + [0] * V), (0.5, 0.5, 16, [1, 0])],
)
def test_threshold_under_auto_draws_the_slots_its_learnt_rates_value_above_t(first, later, budget, kids):
    """With `auto_rates` (sampled children), a slot is worth its parent's chance times its bin's
    learnt rate, and is drawn while that exceeds t: first children worth 0.9 and later siblings
    0.01 grow a chain while 0.9^depth > 1/2 (6 nodes), first children worth 0.6 and later ones 0.9
    a root with all V children. Valued by draft probabilities (no `auto_rates`), both trees are a
    chain of 3 on this draft. The root's first child comes whatever its value: at rates of 1/2 (their
    prior) and t = 1/2 (a cap of 2) the tree was empty, and so was every probe after it."""
    rates = [first] * BINS + [later] * BINS
    g = torch.Generator().manual_seed(0)
    tree = dyspec_threshold.build(SyntheticDraft(), 0, budget, 0.7, g, threshold=0.5, auto_rates=rates)
    assert [len(tree.children(u)) for u in range(len(tree))] == kids


def slot_values(tree: Tree, sample: bool) -> list[float]:
    """The value of the slot that drew each drafted node, read off the tree: for sampled children
    the parent's value less its earlier children's, for chosen children the node's own value."""
    values = [1.0]
    for u in range(len(tree)):
        left = tree.values[u]
        for c in tree.children(u):
            values.append(left if sample else tree.values[c])
            left -= tree.values[c]
    order = [c for u in range(len(tree)) for c in tree.children(u)]
    return [values[1 + order.index(n)] for n in range(1, len(tree))]


@pytest.mark.parametrize("select", ["top", "sample"])
def test_threshold_respects_threshold_and_budget(select):
    g = torch.Generator().manual_seed(0)
    tree = dyspec_threshold.build(SyntheticDraft(), 0, 16, 0.0, g, threshold=0.05, select=select)
    assert 1 <= tree.size <= 16
    # a child is added only while its slot is worth more than t (the root's first whatever its value)
    assert all(v > 0.05 for n, v in enumerate(slot_values(tree, select == "sample"), 1) if n > 1)
    with pytest.raises(DyspecError):
        dyspec_threshold.build(SyntheticDraft(), 0, 16, 0.0, torch.Generator(), threshold=2.0)


def draws_by_row(q: torch.Tensor, k: int, sample: bool, generator=None):
    """`ranked_children` with each row's draw a function of the row alone, so that two builds that
    forward the same nodes in another order draw the same children for them. The row's hash is
    crc32, not `hash`, which changes with each process's PYTHONHASHSEED: the draws repeat."""
    if not sample:
        return ranked_children(q, k, sample)
    seeds = [zlib.crc32(row.numpy().tobytes()) for row in q]
    rows = [ranked_children(row[None], k, True, torch.Generator().manual_seed(seed)) for row, seed in zip(q, seeds)]
    return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])


@pytest.mark.parametrize("select", ["top", "sample"])
def test_threshold_tree_is_the_heaps_tree_of_its_size(monkeypatch, select):
    """DySpec App. A.1: the heap's tree of n nodes (batch 1, the paper's order) is the threshold
    build's tree at any t between its n-th and (n+1)-th slot values, for chosen and sampled children
    (each node's draws the same in both builds)."""
    monkeypatch.setattr(dyspec, "ranked_children", draws_by_row)
    monkeypatch.setattr(dyspec_threshold, "ranked_children", draws_by_row)
    for salt in range(6):
        for budget in (1, 3, 7, 12, 20):
            heap = dyspec.build(SyntheticDraft(salt), 0, budget, 0.0, None, batch=1, select=select)
            t = min(slot_values(heap, select == "sample")) * (1 - 1e-9)
            threshold = dyspec_threshold.build(SyntheticDraft(salt), 0, 200, 0.0, None, threshold=t, select=select)
            assert root_paths(threshold) == root_paths(heap), (salt, budget)


def test_specinfer_expansion():
    tree = specinfer.build([SyntheticDraft()], 0, 16, 0.0, torch.Generator(), expansion="2,2,1")
    assert tree.size == 2 + 4 + 4
    assert [len(tree.children(u)) for u in range(len(tree)) if tree.depths[u] < 3] == [2, 2, 2, 1, 1, 1, 1]
    with pytest.raises(DyspecError, match="over the budget"):
        specinfer.build([SyntheticDraft()], 0, 8, 0.0, torch.Generator(), expansion="2,2,1")


def root_paths(tree: Tree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[i] for i in tree.path(n)) for n in range(1, len(tree))}


def test_specinfer_merges_several_drafts_into_one_tree():
    """At T = 0 the merged tree is the union of each draft's own tree, shared prefixes once."""
    one = [specinfer.build([SyntheticDraft(salt)], 0, 6, 0.0, torch.Generator(), expansion="2,2") for salt in (0, 7)]
    drafts = [SyntheticDraft(0), SyntheticDraft(7)]
    merged = specinfer.build(drafts, 0, 12, 0.0, torch.Generator(), expansion="2,2")
    assert root_paths(merged) == root_paths(one[0]) | root_paths(one[1])
    assert merged.size == len(root_paths(merged)) < 12  # these two drafts share a root child
    # each draft only grows the nodes it proposed itself
    for draft, alone in zip(drafts, one):
        assert {tuple(merged.tokens[i] for i in merged.path(n)) for n in draft.seen} == {()} | {
            p for p in root_paths(alone) if len(p) == 1
        }
    only = specinfer.build(drafts, 0, 12, 0.0, torch.Generator(), expansion="2,2", n_drafts=1)
    assert root_paths(only) == root_paths(one[0])
    with pytest.raises(DyspecError, match="n_drafts"):
        specinfer.build(drafts, 0, 12, 0.0, torch.Generator(), n_drafts=3)
    with pytest.raises(DyspecError, match="over the budget 5"):  # the budget is shared between the drafts
        specinfer.build(drafts, 0, 11, 0.0, torch.Generator(), expansion="2,2")


def test_specinfer_draws_of_each_draft_keep_their_own_proposal():
    drafts = [SyntheticDraft(0), SyntheticDraft(7)]
    tree = specinfer.build(drafts, 0, 8, 1.0, torch.Generator().manual_seed(0), expansion="2,1")
    assert tree.size == 8 and len(tree.children(0)) == 4  # at T > 0 equal draws stay separate nodes
    for n in range(1, len(tree)):
        salt = 7 if n in tree.child_q else 0
        path = tuple(tree.tokens[i] for i in [0, *tree.path(tree.parents[n])])
        torch.testing.assert_close(tree.proposal(n), q_of(path, 1.0, salt))
    with pytest.raises(DyspecError, match="children per depth"):
        specinfer.parse_expansion("2,x", 8)


def eagle2_pool(topk: int, depth: int) -> dict[tuple[int, ...], float]:
    """EAGLE-2's candidates by the paper's rule, path -> cumulative draft probability (T = 1): the
    root's top-k children, then `depth` rounds in which each of the round's k best candidates gets
    its top-k children; every round's candidates stay in the pool."""

    def children(path: tuple[int, ...], value: float) -> list[tuple[tuple[int, ...], float]]:
        probs, tokens = q_of((0, *path), 1.0).topk(topk)
        return [((*path, int(y)), value * float(p)) for p, y in zip(probs, tokens)]

    round_ = children((), 1.0)
    pool = dict(round_)
    for _ in range(depth):
        frontier = sorted(round_, key=lambda c: -c[1])[:topk]
        round_ = [c for path, value in frontier for c in children(path, value)]
        pool.update(round_)
    return pool


@pytest.mark.parametrize("topk,depth", [(1, 3), (2, 1), (2, 4), (3, 2), (3, 4), (4, 3)])
def test_eagle2_reranks_every_candidate_of_every_round(topk, depth):
    """The tree is the `budget` best of the whole pool (topk + depth * topk^2 candidates), never
    fewer nodes than min(budget, pool), from depth + 1 draft forwards; `sglang` is the same build."""
    pool = eagle2_pool(topk, depth)
    assert len(pool) == topk + depth * topk**2
    for budget in (1, 5, 10, 24, 80):
        draft = SyntheticDraft()
        tree = eagle2.build(draft, 0, budget, 0.0, torch.Generator(), topk=topk, depth=depth)
        best = sorted(pool, key=lambda path: -pool[path])[:budget]
        assert tree.size == min(budget, len(pool)) and root_paths(tree) == set(best)
        assert draft.forwards == depth + 1
        assert all(tree.parents[i] < i for i in range(1, len(tree)))
        same = sglang.build(SyntheticDraft(), 0, budget, 0.0, torch.Generator(), topk=topk, steps=depth + 1)
        assert root_paths(same) == root_paths(tree)


class ScriptedHead:
    """An acceptance head that predicts the given values in turn, whatever it reads."""

    def __init__(self, predictions: list[float]):
        self.predictions = iter(predictions)

    def accept_prob(self, hidden: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return torch.tensor(next(self.predictions))


class HiddenDraft(SyntheticDraft):
    @property
    def hidden(self) -> torch.Tensor:
        return torch.zeros(1, 2)


def official_k(predictions: list[float], h: float, min_k: int, max_k: int) -> int:
    """SpecDec++'s chain length by the official loop's rule (its `ada` schedule): after the k-th
    drafted token, the forward that drew it predicted the (k-1)-th's acceptance (the first forward
    reads the root: acceptance 1); stop at k = max_k, never below min_k, else once
    1 - prod(predictions so far) > h."""
    survive = 1.0
    for k in range(1, max_k + 1):
        survive *= 1.0 if k == 1 else predictions[k - 2]
        if k >= max_k or (k >= min_k and 1 - survive > h):
            return k
    raise AssertionError("unreachable")


def test_specdecpp_chain_length_follows_the_official_stop_rule(monkeypatch):
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        h = float(torch.empty(()).uniform_(0.2, 0.9, generator=g))
        min_k, max_k = [(1, 20), (2, 20), (2, 8), (4, 12)][int(torch.randint(4, (), generator=g))]
        budget = int(torch.randint(1, 24, (), generator=g))
        predictions = (0.5 + 0.5 * torch.rand(24, generator=g)).tolist()
        monkeypatch.setattr(specdecpp, "load_head", lambda path, scripted=predictions: (ScriptedHead(scripted), {}))
        draft = HiddenDraft()
        tree = specdecpp.build(draft, 0, budget, 0.0, g, h=h, min_k=min_k, max_k=max_k, head="scripted")
        k = official_k(predictions, h, min(min_k, budget), min(max_k, budget))
        assert tree.size == k and draft.forwards == k  # a stop costs no further draft forward
        assert tree.extra["predicted_acceptance"] == [pytest.approx(p) for p in predictions[: k - 1]] + [None]


def all_shapes(n: int, depth: int):
    """Every ordered tree of n nodes (root included) and height <= depth, as nested tuples."""
    if n == 1:
        yield ()
        return
    if depth == 0:
        return
    for sizes in compositions(n - 1):
        yield from itertools.product(*[list(all_shapes(m, depth - 1)) for m in sizes])


def compositions(n: int):
    if n == 0:
        yield ()
        return
    for first in range(1, n + 1):
        for rest in compositions(n - first):
            yield (first, *rest)


def shape_score(shape, a) -> float:
    return 1.0 + sum(a[k] * shape_score(child, a) for k, child in enumerate(shape) if k < len(a))


@pytest.mark.parametrize(
    "budget,depth,a",
    [
        (1, 1, [0.45, 0.2, 0.1, 0.05]),
        (3, 2, [0.45, 0.2, 0.1, 0.05]),
        (5, 3, [0.45, 0.2, 0.1, 0.05]),
        (6, 6, [0.45, 0.2, 0.1, 0.05]),
        (7, 2, [0.45, 0.2, 0.1, 0.05]),
        (6, 3, [0.9, 0.0, 0.05]),  # measured vectors have zeros: 0 * an impossible subtree must not be NaN
    ],
)
def test_sequoia_dp_matches_brute_force(budget, depth, a):
    parents, score = optimal_tree(tuple(a), budget, depth)
    brute = max(shape_score(s, a) for n in range(1, budget + 2) for s in all_shapes(n, depth))
    assert score == pytest.approx(brute)
    assert tree_score(parents, a) == pytest.approx(score)
    assert len(parents) <= budget + 1
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    assert max(depths) <= depth


class Context(SyntheticDraft):
    """What `lookup` reads of a draft session: the committed tokens, and a draft model (`kv`) or none."""

    def __init__(self, context, kv=None, memo=None):
        super().__init__()
        self.context, self.kv, self.memo = context, kv, {} if memo is None else memo


def test_lookup_builds_a_deterministic_chain():
    tree = lookup.build(Context([3, 1, 2, 0, 3, 1]), 1, 4, 0.7, torch.Generator())
    assert tree.tokens == [1, 2, 0, 3, 1] and tree.parents == [-1, 0, 1, 2, 3]
    assert tree.sampling == "deterministic" and tree.draft_probs == [1.0] * 5 and tree.growth == [5]
    empty = lookup.build(Context([3, 1, 2]), 2, 4, 0.0, torch.Generator())
    assert empty.size == 0 and empty.growth == []


def test_lookup_falls_back_to_the_draft_only_where_nothing_matches():
    draft = Context([3, 1, 2], kv="a draft")
    tree = lookup.build(draft, 2, 4, 0.0, torch.Generator(), fallback=2)
    assert tree.size == 2 and tree.sampling == "iid" and draft.forwards == 2
    assert tree.tokens[1] == int(path_logits((2,)).argmax())  # the draft's chain, as `chain` builds it
    draft = Context([3, 1, 2, 3, 1], kv="a draft")
    tree = lookup.build(draft, 1, 4, 0.0, torch.Generator(), fallback=2)
    assert tree.tokens == [1, 2, 3, 1, 2] and tree.copied_after == 2 and draft.forwards == 0


@pytest.mark.parametrize("confidence", [0.0, 0.3, 0.5, 0.8, 0.95])
def test_chain_stops_once_its_value_falls_below_the_confidence(confidence):
    draft = SyntheticDraft()
    tree = chain.build(draft, 2, 6, 0.0, torch.Generator(), confidence=confidence)
    full = chain.build(SyntheticDraft(), 2, 6, 0.0, torch.Generator())
    # the same chain, cut after its first node valued below the confidence (the draft's top
    # guesses at T = 1: their values fall along it)
    below = [i for i in range(1, len(full)) if full.values[i] < confidence]
    size = below[0] if below else full.size
    assert tree.tokens == full.tokens[: size + 1] and draft.forwards == size
    assert all(v >= confidence for v in tree.values[1:-1])
    assert tree.values[-1] < confidence or tree.size == 6


def test_lookup_fallback_chain_stops_at_the_confidence():
    options = {"fallback": 4, "confidence": 0.5}
    tree = lookup.build(Context([3, 1, 2], kv="a draft"), 2, 4, 0.0, torch.Generator(), **options)
    assert tree.tokens == chain.build(SyntheticDraft(), 2, 4, 0.0, torch.Generator(), confidence=0.5).tokens


@pytest.mark.parametrize("confidence", [-0.1, 1.0])
def test_chain_rejects_a_confidence_outside_0_1(confidence):
    with pytest.raises(DyspecError, match="confidence"):
        chain.build(SyntheticDraft(), 2, 4, 0.0, torch.Generator(), confidence=confidence)


@pytest.mark.parametrize(
    "options", [{"min_ngram": 3, "ngram": 2}, {"min_ngram": 0}, {"fallback": -1}, {"confidence": 1.0}]
)
def test_lookup_rejects_bad_options(options):
    with pytest.raises(DyspecError):
        lookup.build(Context([1, 2, 1]), 2, 4, 0.0, torch.Generator(), **options)


def test_the_policy_contract_is_checked_when_a_policy_is_made():
    from dyspec.core.contract import Policy
    from dyspec.policies import POLICIES
    from dyspec.policies.chain import build as chain_build
    from dyspec.policies.lookup import build as lookup_build

    assert Policy("mine", chain_build, needs_draft=True).options == {"confidence": 0.0, "step": "host"}
    with pytest.raises(TypeError, match="build must take"):
        Policy("multi", chain_build, needs_draft=True, multi_draft=True)  # a multi-draft build takes `drafts`
    with pytest.raises(TypeError, match="free_budget"):
        Policy("copies", lookup_build, needs_draft=False)  # its build takes free_budget, undeclared
    with pytest.raises(TypeError, match="auto_rates"):
        Policy("rates", chain_build, needs_draft=True, auto=AutoNeeds(rates=True))
    with pytest.raises(TypeError, match="shape options"):
        Policy("shaped", chain_build, needs_draft=True, auto=AutoNeeds(shape_options=("expansion",)))
    assert POLICIES["specinfer"].auto.shape_options == ("expansion",) and "expansion" in POLICIES["specinfer"].options
    assert [n for n, p in POLICIES.items() if p.auto.free_nodes] == ["lookup", "suffix"]


def edges(tree: Tree) -> dict[tuple[int, int], float]:
    return {(tree.tokens[tree.parents[i]], tree.tokens[i]): tree.draft_probs[i] for i in range(1, len(tree))}


def test_suffix_grows_the_continuations_of_a_match_by_probability_within_the_references_caps():
    """After the suffix [1, 2], seen three times before: 3 came twice (then 8, then 6), 4 once (then
    5). A path's probability is its count over the match's, the occurrence being matched included
    (4 here); the draft keeps paths of probability >= min_token_prob, at most
    n * max_spec_factor + max_spec_offset of them for a match of n tokens."""
    context = [7, 1, 2, 3, 8, 1, 2, 3, 6, 1, 2, 4, 5, 1, 2]
    tree = suffix.build(Context(context), 2, 3, 0.7, torch.Generator())  # the cap: 2 nodes after a 2-token match
    assert tree.sampling == "deterministic" and tree.copied_after == 2 and tree.growth == [3]
    assert edges(tree) == {(2, 3): pytest.approx(2 / 4), (2, 4): pytest.approx(1 / 4)}
    whole = suffix.build(Context(context), 2, 100, 0.0, None, max_depth=2, max_spec_offset=10, min_token_prob=0)
    assert set(edges(whole)) == {(2, 3), (2, 4), (3, 8), (3, 6), (4, 5)} and whole.copied_after == 2
    assert edges(whole)[3, 8] == pytest.approx(1 / 2)  # its share of its parent's count
    likely = suffix.build(Context(context), 2, 100, 0.0, None, max_spec_offset=10, min_token_prob=0.3)
    assert set(edges(likely)) == {(2, 3)}  # 4 (1/4) and 3 -> 8 (1/4) are below 0.3
    assert suffix.build(Context([3, 1, 2]), 2, 4, 0.0, None).size == 0  # nothing repeats


def test_suffix_keeps_the_match_whose_draft_scores_best():
    """A match of [5, 2] (seen three times, each followed by another token) drafts two paths of 1/4;
    one of [2] (followed by 3 five times of eight) one path of 5/9: the shorter match's draft
    expects more accepted tokens, so it wins, where the longest match would take [5, 2]."""
    context = [2, 3] * 5 + [5, 2, 7, 5, 2, 8, 5, 2, 9, 5, 2]
    tree = suffix.build(Context(context), 2, 8, 0.0, None)
    assert tree.copied_after == 1 and edges(tree) == {(2, 3): pytest.approx(5 / 9)}
    longer = [9, 1, 2, 5, 0, 9, 1, 2, 6, 1, 2, 7, 9, 1, 2]
    tree = suffix.build(Context(longer), 2, 8, 0.0, None)  # [9, 1, 2]: three paths of 1/3 beat [1, 2]'s
    assert tree.copied_after == 3 and tree.size == 3 and tree.tokens[1] in (5, 6)


def test_suffix_searches_the_pairs_earlier_answers_too():
    """An answer the pair gave before is searched beside the context, as the reference's global tree:
    a suffix that never occurred in this generation is found there."""
    memo = {}
    first = Context([4, 4, 1, 2, 3, 5, 6], memo=memo)  # prompt [4, 4]; its answer grows to 1 2 3 5 6
    first.context = [4, 4]
    suffix.build(first, 4, 4, 0.0, None)  # meets the generation: its answer starts after [4, 4]
    first.context += [1, 2, 3, 5, 6]
    second = Context([8, 1, 2], memo=memo)  # a new generation: the first's answer joins the memory
    tree = suffix.build(second, 2, 8, 0.0, None)
    assert tree.copied_after == 2 and edges(tree) == {(2, 3): 1.0, (3, 5): 1.0}
    assert suffix.build(Context([8, 1, 2]), 2, 8, 0.0, None).size == 0  # without the memory, nothing repeats


@pytest.mark.parametrize("options", [{"min_match": 3, "max_match": 2}, {"min_match": 0}, {"max_depth": 0}])
def test_suffix_rejects_bad_options(options):
    with pytest.raises(DyspecError):
        suffix.build(Context([1, 2, 1]), 2, 4, 0.0, torch.Generator(), **options)


def test_recycling_grows_its_tree_from_the_targets_earlier_top_k():
    """Token Recycling's table keeps, per token, the target's top-k successors as last verified; the
    tree grows from the root through it best-first by rank, and is empty until the table knows the
    root."""
    from dyspec.core.draft import DraftSession
    from dyspec.policies import recycling

    draft = DraftSession(None, [0])
    g = torch.Generator().manual_seed(0)
    assert recycling.build(draft, 0, 8, 0.0, g).size == 0  # nothing learnt yet: an `ar` step
    seen = Tree.root(0, "deterministic")
    seen.add(0, 5, 1.0)
    logits = torch.zeros(2, 20)
    logits[0, [5, 6, 7]] = torch.tensor([3.0, 2.0, 1.0])  # after token 0: 5, then 6, then 7
    logits[1, [0, 9]] = torch.tensor([3.0, 2.0])  # after token 5: 0, then 9
    recycling.learn(draft, seen, logits)
    assert draft.memo["recycling"][0][:3] == [5, 6, 7] and draft.memo["recycling"][5][:2] == [0, 9]
    tree = recycling.build(draft, 0, 4, 0.0, g, width=2)
    # by value: root's rank 0 (5: 0.6), its rank 0 (0: 0.36), its rank 0 (5: 0.216), root's rank 1 (6: 0.15)
    assert tree.tokens == [0, 5, 0, 5, 6] and tree.parents == [-1, 0, 1, 2, 0]
    assert tree.sampling == "deterministic"


def test_recycling_fills_the_papers_template_from_its_table():
    """shape="template": the paper's 80 rank paths ("2.2.2") in its order, the first `budget` of them
    whose parent's token the table knows; a rank past `width` and a depth past `max_depth` are left out."""
    from dyspec.core.draft import DraftSession
    from dyspec.export import tree_paths
    from dyspec.policies import recycling

    draft = DraftSession(None, [0], memo={"recycling": {t: [t * 8 + r + 1 for r in range(8)] for t in range(5000)}})
    g = torch.Generator()
    for budget in (1, 8, 30, 80, 100):
        tree = recycling.build(draft, 0, budget, 0.0, g, shape="template")
        assert tree_paths(tree.parents) == list(recycling.TEMPLATE[:budget])
        assert all(tree.tokens[n] == tree.tokens[tree.parents[n]] * 8 + rank + 1 for n, rank in ranks(tree))
    narrow = recycling.build(draft, 0, 80, 0.0, g, shape="template", width=2, max_depth=3)
    kept = [p for p in recycling.TEMPLATE if max(p) < 2 and len(p) <= 3]
    assert tree_paths(narrow.parents) == kept
    draft.memo["recycling"] = {0: [7, 8]}  # only the root is known, and two of its successors
    assert tree_paths(recycling.build(draft, 0, 80, 0.0, g, shape="template").parents) == [(0,), (1,)]
    with pytest.raises(DyspecError, match="shape"):
        recycling.build(draft, 0, 8, 0.0, g, shape="ring")


def ranks(tree: Tree) -> list[tuple[int, int]]:
    """(node, its rank among its siblings) for every drafted node."""
    return [(c, k) for u in range(len(tree)) for k, c in enumerate(tree.children(u))]


def test_a_replay_refuses_a_policy_that_learns_from_the_target(default_pair):
    from dyspec.decode.replay import Trace, replay_run

    trace = Trace(prompt_ids=[1, 2, 3], tokens=[4, 5], max_new_tokens=2, features=None, steps=[])
    with pytest.raises(DyspecError, match="learns from the target's logits"):
        replay_run(default_pair, trace, "recycling", 8)
