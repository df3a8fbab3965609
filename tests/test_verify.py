"""Each verifier must reproduce the target distribution exactly (Monte Carlo, chi-square)."""

import functools

import pytest
import torch
from scipy.stats import chisquare

from dyspec.core import programs, tree_tensors
from dyspec.core.sampling import ranked_children, residual, sample_rows
from dyspec.core.tree import Tree
from dyspec.core.verify import verify_greedy, verify_sampled

V = 50
TRIALS = 100_000


def random_dist(g: torch.Generator, n: int = V, sharpness: float = 2.0) -> torch.Tensor:
    return torch.softmax(torch.randn(n, generator=g) * sharpness, dim=0)


def draw_children(q: torch.Tensor, k: int, sampling: str, g: torch.Generator) -> list[int]:
    if sampling == "iid":
        return torch.multinomial(q, k, replacement=True, generator=g).tolist()
    if sampling == "without_replacement":
        return torch.multinomial(q, k, replacement=False, generator=g).tolist()
    return torch.topk(q, k).indices.tolist()  # deterministic: chosen, not sampled


def verify_on_device(
    tree: Tree, p: torch.Tensor, g: torch.Generator, compiled: bool = False, visits: int = 8
) -> tuple[list[int], int]:
    """`tree_tensors.verify_sampled` (the step on the device's verifier) on the same tree as tensors,
    its walk compiled where `compiled` (dyspec.core.programs), `visits` nodes a call."""
    t = tree_tensors.new_tree(tree.tokens[0], len(tree), p.device, tree.sampling, None)
    for node in range(1, len(tree)):  # one at a time: a child's depth reads its parent's
        parent, token = torch.tensor([tree.parents[node]]), torch.tensor([tree.tokens[node]])
        prob = torch.tensor([tree.draft_probs[node]], dtype=torch.float64)
        tree_tensors.add_nodes(t, node, parent, token, prob, torch.tensor([True]))
    t.q = [(q[None], [u]) for u, q in tree.q.items()]
    accepted, next_token = tree_tensors.verify_sampled(t, p, g, compiled=compiled, visits=visits)
    assert not programs.FAILED
    return [i for i in range(len(t)) if accepted[i]], int(next_token)


# each verifier and its trials: the device's runs an op per tensor step, so fewer
VERIFIERS = [(verify_sampled, 1), (verify_on_device, 5)]
# the walk compiled, in calls of 3 visits (7 nodes: 3 calls, the last past the tree)
COMPILED_WALK = (functools.partial(verify_on_device, compiled=True, visits=3), 5)


def assert_same_distribution(counts: torch.Tensor, p: torch.Tensor) -> None:
    expected = p * counts.sum()
    keep = expected >= 5  # chi-square needs enough expected mass per cell; pool the rest
    obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    pvalue = chisquare(obs.numpy(), exp.numpy()).pvalue
    assert pvalue > 1e-4, f"emitted tokens do not follow the target distribution (p-value {pvalue:.2g})"


@pytest.mark.parametrize("verify, fewer", VERIFIERS, ids=["host", "device"])
@pytest.mark.parametrize("sampling", ["iid", "without_replacement", "deterministic"])
def test_one_level_tree_keeps_target_distribution(sampling, verify, fewer):
    """Root with 3 children: the first emitted token must be distributed as p(root)."""
    g = torch.Generator().manual_seed(0)
    p_root, q = random_dist(g), random_dist(g)
    p_leaf = random_dist(g)
    counts = torch.zeros(V)
    for _ in range(TRIALS // fewer):
        tree = Tree.root(0, sampling)
        tree.q[0] = q
        for x in draw_children(q, 3, sampling, g):
            tree.add(0, x, float(q[x]))
        p = torch.stack([p_root] + [p_leaf] * tree.size)
        path, nxt = verify(tree, p, g)
        counts[tree.tokens[path[0]] if path else nxt] += 1
    assert_same_distribution(counts, p_root)


def test_residual_is_needed():
    """The test above can fail: a verifier that samples p after rejection (no residual) is biased."""
    g = torch.Generator().manual_seed(0)
    p, q = random_dist(g), random_dist(g)
    counts = torch.zeros(V)
    for _ in range(20_000):
        x = int(torch.multinomial(q, 1, generator=g))
        accept = float(torch.rand((), generator=g)) * q[x] <= p[x]
        counts[x if accept else int(torch.multinomial(p, 1, generator=g))] += 1
    with pytest.raises(AssertionError):
        assert_same_distribution(counts, p)


@pytest.mark.parametrize("verify, fewer", [*VERIFIERS, COMPILED_WALK], ids=["host", "device", "device-compiled"])
@pytest.mark.parametrize("sampling", ["iid", "without_replacement", "deterministic"])
def test_two_level_tree_keeps_joint_distribution(sampling, verify, fewer):
    """A 2-level tree over 6 tokens: the first two emitted tokens follow p(x1) p(x2 | x1)."""
    n, g = 6, torch.Generator().manual_seed(1)
    p_root = random_dist(g, n)
    p_next = torch.stack([random_dist(g, n) for _ in range(n)])  # p(. | x1)
    p_after = random_dist(g, n)  # what follows two tokens: irrelevant to the first two
    q_root = random_dist(g, n)
    q_next = torch.stack([random_dist(g, n) for _ in range(n)])
    counts = torch.zeros(n * n)
    for _ in range(40_000 // fewer):
        tree = Tree.root(0, sampling)
        tree.q[0] = q_root
        for x in draw_children(q_root, 2, sampling, g):
            child = tree.add(0, x, float(q_root[x]))
            tree.q[child] = q_next[x]
            for y in draw_children(q_next[x], 2, sampling, g):
                tree.add(child, y, float(q_next[x][y]))
        p = torch.stack([p_root] + [p_next[t] if d == 1 else p_after for t, d in zip(tree.tokens[1:], tree.depths[1:])])
        path, nxt = verify(tree, p, g)
        emitted = [tree.tokens[i] for i in path] + [nxt]
        if len(emitted) == 1:  # rejected at the root: the second token comes from p(. | x1)
            emitted.append(int(torch.multinomial(p_next[emitted[0]], 1, generator=g)))
        counts[emitted[0] * n + emitted[1]] += 1
    assert_same_distribution(counts, (p_root[:, None] * p_next).flatten())


def test_greedy_follows_argmax_and_adds_bonus():
    tree = Tree.root(7)
    a = tree.add(0, 3, 0.5)
    b = tree.add(0, 4, 0.3)
    c = tree.add(b, 9, 0.9)
    argmax = {0: 4, a: 1, b: 9, c: 2}
    assert verify_greedy(tree, [argmax[i] for i in range(len(tree))]) == ([b, c], 2)
    argmax[0] = 5
    assert verify_greedy(tree, [argmax[i] for i in range(len(tree))]) == ([], 5)


def test_residual_guard():
    p = torch.tensor([0.5, 0.5])
    assert torch.equal(residual(p, p), p)
    assert torch.allclose(residual(p, torch.tensor([0.75, 0.25])), torch.tensor([0.0, 1.0]))


def test_ranked_children_samples_without_replacement():
    """The first two children of each row are an ordered draw without replacement:
    P(a, b) = q[a] q[b] / (1 - q[a])."""
    q = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tokens, probs = ranked_children(q.expand(TRIALS, 4), 2, sample=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(probs, q[tokens])
    pairs = [(a, b) for a in range(4) for b in range(4) if a != b]
    counts = torch.bincount(tokens[:, 0] * 4 + tokens[:, 1], minlength=16)[[a * 4 + b for a, b in pairs]]
    expected = torch.tensor([float(q[a] * q[b] / (1 - q[a])) for a, b in pairs], dtype=torch.float64)
    expected *= TRIALS / expected.sum()  # sums to 1 up to float rounding, which chisquare refuses
    assert chisquare(counts.double().numpy(), expected.numpy()).pvalue > 1e-4


def test_sample_rows_draws_each_row_from_its_distribution():
    q = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.1, 0.0, 0.9], [0.25, 0.25, 0.25, 0.25]])
    draws = sample_rows(q, TRIALS, torch.Generator().manual_seed(0))
    for row, d in zip(q, draws):
        counts = torch.bincount(d, minlength=4).double()
        assert counts[row == 0].sum() == 0  # never a zero-probability token
        expected = row.double() / row.double().sum() * TRIALS
        assert chisquare(counts[row > 0].numpy(), expected[row > 0].numpy()).pvalue > 1e-4
