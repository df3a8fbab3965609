"""The compiled forward's attention kernel (dyspec.kernels.row_attention): softmax attention over the
cache slots each row sees, and a row's bits independent of everything but its own keys."""

import pytest
import torch

from dyspec.kernels.row_attention import keep_slots, load, row_attention, visible_slots

load()
HKV, G, D, CAPACITY = 3, 3, 64, 256
# (key heads, query heads per key head, head size): the default pair's; heads taken in several passes
# (7 at 64, 4 at 128); a head size the kernel has no vector path for
SHAPES = [(HKV, G, D), (2, 7, 64), (2, 4, 128), (2, 2, 48)]


def cache(seed: int, hkv: int = HKV, d: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(hkv, CAPACITY, d, generator=g), torch.randn(hkv, CAPACITY, d, generator=g)


def reference(q, keys, values, slots, counts, scale):
    """Each row in float64: gather its keys, softmax, weigh the values."""
    rows = []
    g = q.shape[1] // keys.shape[0]
    for r in range(len(q)):
        seen = slots[r, : counts[r]]
        k = keys[:, seen].double().repeat_interleave(g, 0)  # [H, m, d]
        v = values[:, seen].double().repeat_interleave(g, 0)
        w = torch.softmax(torch.einsum("hd,hmd->hm", q[r].double(), k) * scale, -1)
        rows.append(torch.einsum("hm,hmd->hd", w, v))
    return torch.stack(rows).float()


@pytest.mark.parametrize(("end", "n"), [(1, 1), (2, 1), (100, 1), (130, 2), (200, 7)])
@pytest.mark.parametrize(("hkv", "g", "d"), SHAPES)
def test_it_is_attention_over_the_slots_each_row_sees(end, n, hkv, g, d):
    keys, values = cache(end, hkv, d)
    q = torch.randn(n, hkv * g, d, generator=torch.Generator().manual_seed(n))
    tree = torch.ones(n, n, dtype=torch.bool).tril()
    tree[n // 2 :, : n // 2] = False  # rows in two branches
    mask = torch.cat([torch.ones(n, end - n, dtype=torch.bool), tree], 1)[None, None]
    slots, counts = visible_slots(mask, n, end)
    assert slots.shape[1] >= 2 and counts.tolist() == mask[0, 0].sum(1).tolist()
    got = row_attention(q, keys, values, slots, counts, d**-0.5)
    assert (got - reference(q, keys, values, slots, counts, d**-0.5)).abs().max() < 1e-5


@pytest.mark.parametrize("seed", range(6))
def test_visible_slots_are_each_rows_visible_slots_in_order(seed):
    """Against each row's nonzero columns: boolean and additive masks whose rows share a prefix of any
    length (none too), with gaps after it, and causal forwards (no mask)."""
    g = torch.Generator().manual_seed(seed)
    n, end = 1 + seed * 3, 40 + seed * 7
    see = torch.rand(n, end, generator=g) < 0.5
    see[:, : seed * 5] = True
    see[torch.arange(n), end - n + torch.arange(n)] = True  # each row sees itself
    additive = torch.zeros(n, end).masked_fill(~see, float("-inf"))
    causal = torch.ones(n, end, dtype=torch.bool).tril(end - n)
    for mask, visible in ((see[None, None], see), (additive[None, None], see), (None, causal)):
        slots, counts = visible_slots(mask, n, end)
        assert slots.shape[1] >= 2 and slots.is_contiguous()
        for r in range(n):
            assert slots[r, : counts[r]].tolist() == visible[r].nonzero()[:, 0].tolist()


@pytest.mark.parametrize(("hkv", "g", "d"), SHAPES)
def test_a_row_depends_on_its_own_keys_only(hkv, g, d):
    """Bit for bit: alone, beside other rows, with more slot columns than it reads, and with its keys
    copied to other slots of the cache (gathered, as an eager forward gathers them). Rows of 142 to
    150 keys: keys past the last multiple of four and of sixteen, which the kernel takes in blocks."""
    keys, values = cache(0, hkv, d)
    q = torch.randn(9, hkv * g, d, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(9, 150, dtype=torch.bool).tril(141)[None, None]
    slots, counts = visible_slots(mask, 9, 150)
    together = row_attention(q, keys, values, slots, counts, 0.125)
    for r in range(9):
        m = int(counts[r])
        alone = row_attention(q[r : r + 1], keys, values, slots[r : r + 1, :m], counts[r : r + 1], 0.125)
        assert torch.equal(alone, together[r : r + 1])
        moved_k, moved_v = torch.zeros_like(keys), torch.zeros_like(values)
        moved_k[:, 100 : 100 + m], moved_v[:, 100 : 100 + m] = keys[:, slots[r, :m]], values[:, slots[r, :m]]
        moved = torch.arange(100, 100 + m)[None]
        assert torch.equal(row_attention(q[r : r + 1], moved_k, moved_v, moved, counts[r : r + 1], 0.125), alone)


def test_it_names_what_is_wrong():
    keys, values = cache(0)
    q = torch.randn(1, HKV * G, D)
    with pytest.raises(RuntimeError, match="a slot past the cache"):
        row_attention(q, keys, values, torch.tensor([[0, CAPACITY]]), torch.tensor([2]), 0.125)
    with pytest.raises(RuntimeError, match="each row sees 1 to C slots"):
        row_attention(q, keys, values, torch.tensor([[0, 1]]), torch.tensor([3]), 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        row_attention(q.double(), keys, values, torch.tensor([[0, 1]]), torch.tensor([2]), 0.125)


@pytest.mark.parametrize("slots", [[5, 9, 12], [3, 4, 5], [3, 10], [20], [7, 3]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keep_slots_moves_each_tensors_slots_as_tensor_ops_do(slots, dtype):
    """A commit's moves, in one call of the kernel where the slots ascend from `start` ([7, 3] does
    not: it takes the tensor ops), equal moving them with index_select, in every layer's tensor."""
    start = 3
    g = torch.Generator().manual_seed(len(slots))
    caches = [torch.randn(1, HKV, 32, D, generator=g).to(dtype) for _ in range(4)]
    expected = [t.clone() for t in caches]
    for t in expected:
        t[:, :, start : start + len(slots)] = t[:, :, slots].clone()
    kernel = [t.clone() for t in caches]
    keep_slots(caches, slots, start)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)
    if slots == sorted(slots):  # the kernel itself, as `keep_slots` calls it here
        torch.ops.dyspec.keep_slots(kernel, slots, start)
        assert all(torch.equal(got, want) for got, want in zip(kernel, expected))


def test_keep_slots_refuses_slots_the_kernel_cannot_move_in_place():
    caches = [torch.zeros(HKV, 32, D)]
    with pytest.raises(RuntimeError, match="ascending slots"):
        torch.ops.dyspec.keep_slots(caches, [4, 2], 1)
    with pytest.raises(RuntimeError, match="ascending slots"):
        torch.ops.dyspec.keep_slots(caches, [1], 2)  # before its place: a copy would overwrite
    with pytest.raises(RuntimeError, match="hold the slots"):
        torch.ops.dyspec.keep_slots(caches, [40], 1)
