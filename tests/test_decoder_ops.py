"""The native RMSNorm (with the residual add) and RoPE against the eager ops they replace (issue 15, part 2):
rounded step by step as PyTorch rounds, so RoPE and the residual sum are bit-identical in bfloat16 and the
norm differs at most by one bfloat16 step where a float32 sum of squares rounds differently."""

import pytest
import torch

from goodserve.models import native
from goodserve.models.llama import _rms_norm, _rotate

pytestmark = pytest.mark.skipif(not native.load(), reason="the native kernels cannot be built here")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bfloat16 steps between two bfloat16 tensors of finite values of one sign per element."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("rows", [1, 16, 200])
def test_rms_norm_with_residual_matches_the_eager_ops(rows):
    torch.manual_seed(rows)
    qkv = torch.randn(rows, 700).bfloat16() * 3
    x = qkv[:, :576]  # a row stride, as a slice of a wider output
    residual = torch.randn(rows, 576).bfloat16()
    weight = (torch.rand(576) + 0.5).bfloat16()
    normed, h = native.rms_norm(x, weight, 1e-5, residual)
    want_h = x + residual
    assert torch.equal(h, want_h)  # the residual stream: bit for bit
    want = _rms_norm(want_h, weight, 1e-5)
    off = _ulps(normed, want)
    assert off.max() <= 1 and (off > 0).float().mean() < 0.01
    alone, same = native.rms_norm(x, weight, 1e-5)
    assert same is x and _ulps(alone, _rms_norm(x, weight, 1e-5)).max() <= 1


def test_rms_norm_float32():
    torch.manual_seed(0)
    x, r, w = torch.randn(5, 64), torch.randn(5, 64), torch.rand(64)
    normed, h = native.rms_norm(x, w, 1e-6, r)
    torch.testing.assert_close(h, x + r, rtol=0, atol=0)
    torch.testing.assert_close(normed, _rms_norm(x + r, w, 1e-6), rtol=1e-6, atol=1e-6)


def test_rms_norm_row_tails_and_non_finite_values():
    """Rows whose length is no multiple of the kernel's 16 lanes, and rows holding inf or NaN: the values
    eager PyTorch gives, NaN where it gives NaN."""
    torch.manual_seed(1)
    x, r = torch.randn(4, 100).bfloat16(), torch.randn(4, 100).bfloat16()
    x[1, 99], x[2, 3], x[3, 50] = float("nan"), float("inf"), 3e38
    r[3, 50] = 3e38  # the residual sum overflows to inf in bfloat16
    w = (torch.rand(100) + 0.5).bfloat16()
    normed, h = native.rms_norm(x, w, 1e-5, r)
    want_h = x + r
    assert torch.equal(h.isnan(), want_h.isnan()) and torch.equal(h.nan_to_num(), want_h.nan_to_num())
    want = _rms_norm(want_h, w, 1e-5)
    assert torch.equal(normed.isnan(), want.isnan()) and normed.isnan().any()
    finite = ~want.isnan()
    assert _ulps(normed[finite], want[finite]).max() <= 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_is_bit_identical_to_the_eager_ops(dtype):
    torch.manual_seed(1)
    rows, heads, d = 37, 12, 64
    qkv = torch.randn(rows, (heads + 3) * d).to(dtype)
    x = qkv[:, :heads * d].view(rows, heads, d)  # strided rows, as q and k of the fused projection
    pos = torch.arange(1000, dtype=torch.float32)[:, None] * 10000 ** (-torch.arange(0, d, 2) / d)
    emb = torch.cat([pos, pos], -1)
    table = torch.stack([emb.cos(), emb.sin()]).to(dtype)  # [2, 1000, d]
    positions = torch.randint(0, 1000, (rows,))
    got = native.rope(x, table, positions)
    cos, sin = table.index_select(1, positions)[:, :, None, :]
    assert got.is_contiguous() and torch.equal(got, _rotate(x, cos, sin))


def test_bad_inputs_are_refused():
    x = torch.randn(3, 8).bfloat16()
    with pytest.raises(ValueError, match="weight"):
        native.rms_norm(x, torch.ones(8), 1e-6)  # float32 weight for bfloat16 rows
    with pytest.raises(ValueError, match="contiguous rows"):
        native.rms_norm(x.t(), torch.ones(3).bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        native.rms_norm(x, torch.ones(8).bfloat16(), 1e-6, torch.randn(2, 8).bfloat16())
    table = torch.randn(2, 10, 8).bfloat16()
    with pytest.raises(ValueError, match="positions"):
        native.rope(torch.randn(3, 2, 8).bfloat16(), table, torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="table"):
        native.rope(torch.randn(3, 2, 4).bfloat16(), table, torch.tensor([1, 2, 3]))
