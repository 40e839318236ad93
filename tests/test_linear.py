"""Dense linear layers on a prepacked oneDNN weight (models/linear.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from goodserve.models.linear import PackedLinear, can_pack, dense_linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 200])
@pytest.mark.parametrize("shape", [(192, 64), (64, 160)])
def test_packed_linear_gives_f_linear_values(rows, shape):
    torch.manual_seed(rows)
    w = torch.randn(shape).bfloat16()
    b = torch.randn(shape[0]).bfloat16()
    x = torch.randn(rows, shape[1]).bfloat16()
    assert torch.equal(PackedLinear(w)(x), F.linear(x, w))
    assert torch.equal(PackedLinear(w, b)(x), F.linear(x, w, b))


def test_dense_linear_packs_bfloat16_on_cpu_only():
    w = torch.randn(64, 32)
    assert can_pack(w.bfloat16()) and not can_pack(w)
    assert isinstance(dense_linear(w.bfloat16()), PackedLinear)
    layer = dense_linear(w, torch.zeros(64))
    assert isinstance(layer, nn.Linear) and torch.equal(layer.weight, w)
    with pytest.raises(ValueError, match="cannot prepack a torch.float32 weight"):
        PackedLinear(w)
    assert PackedLinear(w.bfloat16()).nbytes == 64 * 32 * 2
