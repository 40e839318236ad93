"""Dense linear layers on a prepacked oneDNN weight (models/linear.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from goodserve.engine.args import resolve_dtype
from goodserve.models import linear
from goodserve.models.linear import PackedLinear, can_pack, dense_linear, onednn_has_bfloat16

BF16_PATH = onednn_has_bfloat16()
needs_bf16_path = pytest.mark.skipif(not BF16_PATH, reason="oneDNN has no bfloat16 path on this CPU (AVX2 only)")


@needs_bf16_path
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 200])
@pytest.mark.parametrize("shape", [(192, 64), (64, 160)])
def test_packed_linear_gives_f_linear_values(rows, shape):
    torch.manual_seed(rows)
    w = torch.randn(shape).bfloat16()
    b = torch.randn(shape[0]).bfloat16()
    x = torch.randn(rows, shape[1]).bfloat16()
    assert torch.equal(PackedLinear(w)(x), F.linear(x, w))
    assert torch.equal(PackedLinear(w, b)(x), F.linear(x, w, b))


@needs_bf16_path
def test_dense_linear_packs_bfloat16_on_cpu_only():
    w = torch.randn(64, 32)
    assert can_pack(w.bfloat16()) and not can_pack(w)
    assert isinstance(dense_linear(w.bfloat16()), PackedLinear)
    layer = dense_linear(w, torch.zeros(64))
    assert isinstance(layer, nn.Linear) and torch.equal(layer.weight, w)
    with pytest.raises(ValueError, match="cannot prepack a torch.float32 weight"):
        PackedLinear(w)
    assert PackedLinear(w.bfloat16()).nbytes == 64 * 32 * 2


@pytest.mark.skipif(BF16_PATH, reason="this CPU has oneDNN's bfloat16 path")
def test_dense_linear_stays_on_f_linear_where_onednn_has_no_bfloat16_path():
    """On an AVX2-only CPU oneDNN's reorder raises for bfloat16: such a weight stays an ``nn.Linear``."""
    w = torch.randn(64, 32).bfloat16()
    assert not can_pack(w)
    layer = dense_linear(w)
    assert isinstance(layer, nn.Linear) and torch.equal(layer.weight, w)
    with pytest.raises(ValueError, match="cannot prepack"):
        PackedLinear(w)


def test_dtype_auto_is_bfloat16_only_where_the_cpu_has_a_fast_path(monkeypatch):
    for fast, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(linear, "onednn_has_bfloat16", lambda fast=fast: fast)
        assert resolve_dtype("auto", "cpu") == want
        assert resolve_dtype("auto", "cuda:0") == "bfloat16"
        assert resolve_dtype("float32", "cpu") == "float32" and resolve_dtype("bfloat16", "cpu") == "bfloat16"
