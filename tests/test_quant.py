"""Low-bit weights (``goodserve.models.quant``): the file's blocks, the kernels' layouts, and their accuracy.

Synthetic tensors are quantized with ``gguf.quants`` (llama.cpp's reference quantizers, in numpy), so the
expected values are the file's own dequantization, not ours.
"""

import numpy as np
import pytest
import torch
from torch import nn

from goodserve.models.quant import (BlockQuantized, QuantLinear, make_linear, pack_int4, quantize_int4,
                                    unpack_gguf_blocks, unpack_int4)


def _gguf_weight(qtype: str, n: int = 128, k: int = 96, seed: int = 0):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.uniform(-0.02, 0.02, (n, 1))).astype(np.float32)
    t = GGMLQuantizationType[qtype]
    data = quantize(w, t)  # [n, bytes_per_row] uint8, the file's bytes
    return data, torch.from_numpy(dequantize(data, t).reshape(n, k))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_unpacked_blocks_dequantize_exactly_as_gguf(qtype):
    data, ref = _gguf_weight(qtype)
    w = unpack_gguf_blocks(data, qtype, (128, 96))
    assert w.q.shape == (128, 96) and w.scales.shape == (128, 3)
    assert torch.equal(w.dequantize(), ref)


def test_unpack_rejects_wrong_sizes():
    data, _ = _gguf_weight("Q4_1")
    with pytest.raises(ValueError, match="does not hold"):
        unpack_gguf_blocks(data, "Q4_1", (128, 64))
    with pytest.raises(ValueError, match="no block layout"):
        unpack_gguf_blocks(data, "Q5_K", (128, 96))


def _kernel_weight(packed, sz):
    """The weight the int4 kernel multiplies by, read back through the kernel: ``I @ W^T`` in float32."""
    k = packed.shape[1] * 2
    return torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k), packed, 32, sz).t()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_kernel_holds_the_file_weights(qtype):
    """The packed layout with float32 scales is the file's dequantized weight: Q4_0 bit for bit, Q4_1 up to
    the float32 rounding of ``zero = m + 8d`` (the kernel computes ``(q - 8) * d + zero``, the file
    ``d * q + m``)."""
    data, ref = _gguf_weight(qtype)
    packed, sz = pack_int4(unpack_gguf_blocks(data, qtype, (128, 96)), torch.float32)
    got = _kernel_weight(packed, sz)
    if qtype == "Q4_0":
        assert torch.equal(got, ref)
    else:
        eps = torch.finfo(torch.float32).eps
        bound = 2 * eps * sz[..., 1].abs().max() + 2 * eps * ref.abs().max()
        assert (got - ref).abs().max() <= bound
    # The dense copy for large steps is read from the packed bytes: the same weight.
    assert torch.equal(unpack_int4(packed, sz, torch.float32), got)


def test_int4_rotary_row_permutation_and_fusion_commute_with_packing():
    data, ref = _gguf_weight("Q4_1", n=64)
    data2, ref2 = _gguf_weight("Q4_1", n=64, seed=1)
    a, b = unpack_gguf_blocks(data, "Q4_1", (64, 96)), unpack_gguf_blocks(data2, "Q4_1", (64, 96))
    index = torch.randperm(64)
    fused = BlockQuantized.cat([a.permute_rows(index), b])
    assert torch.equal(fused.dequantize(), torch.cat([ref[index], ref2]))
    with pytest.raises(ValueError, match="different quantization types"):
        BlockQuantized.cat([a, unpack_gguf_blocks(_gguf_weight("Q4_0", n=64)[0], "Q4_0", (64, 96))])


def test_int4_packing_needs_rows_in_tiles_of_64():
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_int4(quantize_int4(torch.randn(96, 64)), torch.bfloat16)


def test_quantize_int4_is_round_to_nearest_within_half_a_step():
    w = torch.randn(64, 128)
    q = quantize_int4(w)
    step = q.scales.repeat_interleave(32, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quant_linear_kernel_and_dense_paths_agree(kind):
    """Small steps run the kernel, large ones the dense copy: both compute with the same weight."""
    torch.manual_seed(0)
    data, ref = _gguf_weight("Q4_1", n=128, k=96)
    weight = unpack_gguf_blocks(data, "Q4_1", (128, 96)) if kind == "int4" else ref
    bias = torch.randn(128)
    layer = QuantLinear(kind, weight, torch.bfloat16, bias, max_rows=4)
    x = torch.randn(8, 96).to(torch.bfloat16)
    small = torch.cat([layer(x[i:i + 4]) for i in (0, 4)])  # kernel
    large = layer(x)  # dense copy
    expect = x.float() @ ref.t() + bias
    scale = expect.abs().max()
    assert (small.float() - large.float()).abs().max() <= 0.02 * scale
    assert (large.float() - expect).abs().max() <= (0.02 if kind == "int4" else 0.05) * scale


def test_make_linear_auto_keeps_4bit_blocks_only_in_bfloat16():
    data, ref = _gguf_weight("Q4_1", n=128)
    w = unpack_gguf_blocks(data, "Q4_1", (128, 96))
    assert isinstance(make_linear(w, None, torch.bfloat16, "auto"), QuantLinear)
    dense = make_linear(w, None, torch.float32, "auto")
    assert isinstance(dense, nn.Linear) and torch.equal(dense.weight, ref)
    q8 = unpack_gguf_blocks(_gguf_weight("Q8_0")[0], "Q8_0", (128, 96))
    assert isinstance(make_linear(q8, None, torch.bfloat16, "auto"), nn.Linear)
    assert isinstance(make_linear(q8, None, torch.bfloat16, "int8"), QuantLinear)
    assert isinstance(make_linear(ref, None, torch.bfloat16, "int4"), QuantLinear)
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_linear(ref, None, torch.bfloat16, "int3")
