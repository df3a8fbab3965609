"""Each row's argmax and logsumexp (dyspec.kernels.row_stats): torch.argmax's index, ties and NaN
included, so greedy decoding keeps its tokens, and torch.logsumexp's value to float32 rounding."""

import subprocess

import pytest
import torch

from dyspec.kernels import row_stats as rs

pytestmark = pytest.mark.skipif(not rs.kernel_available(), reason="the kernel needs a C++ compiler")


@pytest.mark.parametrize("shape", [(1, 49152), (3, 8192), (9, 1000), (2, 5, 37), (16,), (4, 1)])
def test_it_is_torch_argmax_and_logsumexp(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 6
    argmax, lse = rs.row_stats(x)
    assert argmax.shape == lse.shape == shape[:-1]
    assert torch.equal(argmax, x.argmax(-1))
    torch.testing.assert_close(lse, torch.logsumexp(x, -1), rtol=1e-6, atol=1e-5)


def test_a_tie_takes_the_first_largest_entry_and_odd_values_follow_torch():
    x = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    x[0, [40, 7, 93]] = 9.0  # a tie in other lanes and blocks: the first index wins
    x[1, [3, 19]] = 9.0  # a tie within one lane
    x[2, [97, 98]] = 9.0  # a tie in the tail past the last full block
    x[3, [50, 12]] = float("nan")
    x[4] = float("-inf")
    x[5, [70, 30]] = float("inf")
    argmax, lse = rs.row_stats(x)
    assert argmax.tolist() == x.argmax(-1).tolist() == [7, 3, 97, 12, 0, 30]
    torch.testing.assert_close(lse, torch.logsumexp(x, -1), equal_nan=True)


def test_a_strided_row_reads_its_own_entries():
    x = torch.randn(4, 2000, generator=torch.Generator().manual_seed(1))[:, ::2]
    assert torch.equal(rs.row_stats(x)[0], x.argmax(-1))


def test_other_tensors_take_torch(monkeypatch):
    """bf16 (and a GPU's tensors) never reach the kernel, which takes float32 only; without a
    compiler nothing does."""
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.dyspec.row_stats(x.bfloat16())
    argmax, lse = rs.row_stats(x.bfloat16())
    assert torch.equal(argmax, x.bfloat16().argmax(-1))
    monkeypatch.setattr(rs, "kernel_available", lambda: False)
    argmax, lse = rs.row_stats(x)
    torch.testing.assert_close(lse, torch.logsumexp(x, -1))
    assert torch.equal(argmax, x.argmax(-1))


def test_inverse_cdf_draws_columns_of_positive_probability_as_searchsorted_does():
    g = torch.Generator().manual_seed(3)
    p = torch.rand(3, 49157, generator=g) ** 8  # a tail past the last full block
    p[p < 0.3] = 0  # most columns can never be drawn
    p[2, -1] = 0  # nor the last
    u = torch.rand(3, 4000, dtype=torch.float64, generator=g)
    u[:, 0] = 0.0
    u[:, 1] = 1 - 2**-53
    drawn = rs.inverse_cdf(p, u)
    assert (p.gather(1, drawn) > 0).all()
    cdf = p.double().cumsum(-1)
    expected = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_max(p.shape[-1] - 1)
    # the kernel sums in another order: only a draw within rounding of a column's edge may differ
    assert (drawn != expected).sum() <= 3
    assert torch.equal(drawn[:, :2], expected[:, :2])


def test_inverse_cdf_follows_the_distribution():
    p = torch.tensor([[0.0, 0.5, 0.0, 0.25] + [0.0] * 28 + [0.25]])
    u = torch.rand(1, 40000, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    counts = torch.bincount(rs.inverse_cdf(p, u)[0], minlength=p.shape[1])
    assert counts[[0, 2]].sum() == 0 and counts[4:32].sum() == 0
    torch.testing.assert_close(counts[[1, 3, 32]] / 40000, torch.tensor([0.5, 0.25, 0.25]), atol=0.01, rtol=0)


def test_a_failed_build_warns_and_takes_torch(monkeypatch):
    def fails(source, flags):
        raise subprocess.CalledProcessError(1, "c++", stderr=b"error: no such instruction")

    monkeypatch.setattr(rs, "build", fails)
    rs.kernel_available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="(?s)row kernel did not build.*no such instruction"):
            assert not rs.kernel_available()
        x = torch.randn(2, 50, generator=torch.Generator().manual_seed(5))
        assert torch.equal(rs.row_stats(x)[0], x.argmax(-1))
    finally:
        rs.kernel_available.cache_clear()
