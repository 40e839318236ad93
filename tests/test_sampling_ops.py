"""The native greedy argmax against ``torch.argmax`` (issue 15): the same index on every row, ties (the first
maximum), NaN (the first NaN, as torch), ``-inf`` rows, row strides and lengths that are not a multiple of the
kernel's lanes; and the sampler's greedy path through it."""

import pytest
import torch

from goodserve.models import native
from goodserve.runner.sampler import greedy

pytestmark = pytest.mark.skipif(not native.load(), reason="the native kernels cannot be built here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 17), (16, 49152), (64, 1000), (5, 49157)])
def test_argmax_matches_torch(dtype, rows, cols):
    torch.manual_seed(rows * cols)
    x = (torch.randn(rows, cols) * 4).to(dtype)
    got = native.argmax(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_ties_nan_and_inf_as_torch(dtype):
    cols = 100
    x = torch.zeros(6, cols, dtype=dtype)
    x[0, [7, 40, 93]] = 5.0  # ties: the first
    x[1] = -torch.inf  # every value -inf: index 0
    x[2, [11, 60]] = torch.nan  # NaN wins, the first one
    x[2, 3] = 9.0
    x[3, 99] = torch.inf  # the last element
    x[4, 64] = 1.0  # at a chunk boundary
    x[5] = 2.0  # all equal: index 0
    want = [7, 0, 11, 99, 64, 0]
    assert native.argmax(x).tolist() == want == x.argmax(dim=-1).tolist()


def test_argmax_reads_rows_through_a_stride_and_refuses_what_it_cannot_take():
    torch.manual_seed(0)
    wide = torch.randn(8, 300).bfloat16()
    x = wide[:, 10:250]  # row stride 300
    assert torch.equal(native.argmax(x), x.argmax(dim=-1))
    with pytest.raises(ValueError):
        native.argmax(torch.randn(4, 6).half())
    with pytest.raises(ValueError):
        native.argmax(torch.randn(4, 6).t())  # columns not contiguous


def test_greedy_uses_the_kernel_and_falls_back_to_torch(monkeypatch):
    calls = []
    kernel = native.argmax
    monkeypatch.setattr(native, "argmax", lambda x: calls.append(x.dtype) or kernel(x))
    torch.manual_seed(1)
    for x in (torch.randn(16, 49152), torch.randn(4, 1000).bfloat16()):  # the kernel
        assert torch.equal(greedy(x), x.argmax(dim=-1))
    t = torch.randn(6, 4).t()  # columns strided: torch's argmax
    assert torch.equal(greedy(t), t.argmax(dim=-1))
    h = torch.randn(3, 50).half()  # a dtype the kernel does not take
    assert torch.equal(greedy(h), h.argmax(dim=-1))
    assert calls == [torch.float32, torch.bfloat16]
