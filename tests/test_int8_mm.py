"""dyspec's int8 product (dyspec.kernels.int8_mm): exact int32 sums, the same as torch._int_mm's for
every row count, and a clear fallback where the kernel does not run."""

import pytest
import torch

from dyspec.kernels import int8_mm as kernel

needs_kernel = pytest.mark.skipif(not kernel.kernel_available(), reason="the CPU lacks AVX2")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 17])
@pytest.mark.parametrize(("n", "k"), [(32, 4), (960, 576), (576, 1536)])
def test_the_kernel_is_torch_int_mm_bit_for_bit(rows, n, k):
    """Every row count, one pass of rows or several, full int8 range (-128 included)."""
    g = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    x = torch.randint(-128, 128, (rows, k), dtype=torch.int8, generator=g)
    packed, comp, plain = kernel.int8_operands(weight)
    assert comp is not None and packed.shape == (n // kernel.PANEL, k // 4, kernel.PANEL, 4)
    assert torch.equal(kernel.int8_mm(x, packed, comp, plain), torch._int_mm(x, weight.t()))


@pytest.fixture(params=kernel.PATHS)
def forced_path(request):
    """Products forced to each path the CPU has (AMX only where Linux lends it too), the fastest
    allowed again after."""
    try:
        if kernel.use_path(request.param) != request.param:
            pytest.skip(f"this CPU has no {request.param}")
        yield request.param
    finally:
        kernel.use_path(kernel.PATHS[0])


@needs_kernel
def test_each_path_gives_torch_int_mm_bit_for_bit(forced_path):
    """1 to 33 rows, the shapes of the default target's layers and of its output layer, and a row
    alone equals itself in a batch."""
    assert kernel.kernel_path() == forced_path  # what profiles and bench records name
    g = torch.Generator().manual_seed(7)
    for n, k in [(960, 576), (3072, 576), (576, 1536), (49152, 576), (64, 36)]:
        weight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        ops = kernel.int8_operands(weight)
        for rows in (1, 2, 5, 16, 17, 33):
            x = torch.randint(-128, 128, (rows, k), dtype=torch.int8, generator=g)
            together = kernel.int8_mm(x, *ops)
            assert torch.equal(together, torch._int_mm(x, weight.t())), (n, k, rows)
            assert torch.equal(together[-1:], kernel.int8_mm(x[-1:], *ops))


@needs_kernel
def test_each_path_is_exact_at_the_int8_extremes(forced_path):
    """-128 in x and in the weights, alone and everywhere: the largest sums any path makes, and the
    value AVX2's sign trick cannot take as it is (int8_mm.cpp, `avx2_product`)."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randint(-128, 128, (96, 64), dtype=torch.int8, generator=g)
    weight[:32] = -128
    ops = kernel.int8_operands(weight)
    x = torch.randint(-127, 128, (5, 64), dtype=torch.int8, generator=g)
    x[0] = -128
    x[3, 17] = -128
    x[4] = 127
    assert torch.equal(kernel.int8_mm(x, *ops), torch._int_mm(x, weight.t()))


def test_a_path_is_named():
    with pytest.raises(ValueError, match="amx, vnni, avx-vnni, avx2"):
        kernel.use_path("sse")


@needs_kernel
def test_a_row_does_not_depend_on_its_batch_mates():
    g = torch.Generator().manual_seed(0)
    weight = torch.randint(-128, 128, (64, 32), dtype=torch.int8, generator=g)
    x = torch.randint(-128, 128, (12, 32), dtype=torch.int8, generator=g)
    ops = kernel.int8_operands(weight)
    together = kernel.int8_mm(x, *ops)
    assert all(torch.equal(together[i : i + 1], kernel.int8_mm(x[i : i + 1], *ops)) for i in range(12))


def test_shapes_the_kernel_does_not_pack_run_torch_int_mm():
    weight = torch.randint(-128, 128, (40, 32), dtype=torch.int8)  # 40 outputs: not a whole panel
    x = torch.randint(-128, 128, (3, 32), dtype=torch.int8)
    operands = kernel.int8_operands(weight)
    assert operands[1] is None
    assert torch.equal(kernel.int8_mm(x, *operands), torch._int_mm(x, weight.t()))


@needs_kernel
def test_the_kernel_names_what_it_was_given():
    weight = torch.randint(-128, 128, (64, 32), dtype=torch.int8)
    packed, comp, plain = kernel.int8_operands(weight)
    with pytest.raises(RuntimeError, match="x: a contiguous int8"):
        kernel.int8_mm(torch.zeros(2, 32), packed, comp, plain)
    with pytest.raises(RuntimeError, match="w: packed int8"):
        kernel.int8_mm(torch.zeros(2, 16, dtype=torch.int8), packed, comp, plain)


@needs_kernel
def test_a_failed_build_warns_and_products_run_torch_int_mm(monkeypatch, tmp_path):
    """A machine whose compiler fails: a warning, no kernel, nothing half-written in the cache."""
    monkeypatch.setenv("DYSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.warns(UserWarning, match="did not build; int8 products run torch._int_mm"):
        assert kernel.kernel_available.__wrapped__() is False
    assert not [p for p in (tmp_path / "kernels").iterdir() if not p.name.endswith(".lock")]
