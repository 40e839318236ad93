"""Low-bit weights (``goodserve.models.quant``): the file's blocks, the kernels' layouts, and their accuracy.

Synthetic tensors are quantized with ``gguf.quants`` (llama.cpp's reference quantizers, in numpy), so the
expected values are the file's own dequantization, not ours.
"""

import numpy as np
import pytest
import torch
from torch import nn

from goodserve.models.quant import (DEFAULT_MAX_ROWS, DENSE_AFTER_ROWS, FLOAT32_BLOCKS_MAX_ROWS, BlockQuantized,
                                    QuantLinear, dequantize_rows,
                                    make_dense_copies, make_linear, pack_int4, pack_int4_codes, quantize_int4,
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


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_by_rows_as_gguf_dequantizes(qtype, dtype):
    data, ref = _gguf_weight(qtype, n=100)
    got = dequantize_rows(unpack_gguf_blocks(data, qtype, (100, 96)), dtype, rows=32)  # 4 chunks, one short
    assert got.dtype == dtype and torch.equal(got, ref.to(dtype))


@pytest.mark.parametrize("n, k", [(64, 32), (192, 576), (3072, 576)])
def test_int4_codes_packed_as_pytorch_packs_them(n, k):
    torch.manual_seed(n)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    assert torch.equal(pack_int4_codes(q), want)


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
    layer = QuantLinear(kind, weight, torch.bfloat16, bias, max_rows=4, dense_after_rows=0)
    x = torch.randn(8, 96).to(torch.bfloat16)
    small = torch.cat([layer(x[i:i + 4]) for i in (0, 4)])  # kernel
    large = layer(x)  # dense copy
    expect = x.float() @ ref.t() + bias
    scale = expect.abs().max()
    assert (small.float() - large.float()).abs().max() <= 0.02 * scale
    assert (large.float() - expect).abs().max() <= (0.02 if kind == "int4" else 0.05) * scale


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_dense_copy_is_made_once_large_steps_reach_dense_after_rows(kind):
    """Ski rental: steps past ``max_rows`` run on the kernel until their rows reach ``dense_after_rows``; the
    step that reaches it and every large step after it run on the dense copy."""
    torch.manual_seed(0)
    data, ref = _gguf_weight("Q4_1", n=128, k=96)
    weight = unpack_gguf_blocks(data, "Q4_1", (128, 96)) if kind == "int4" else ref
    layer = QuantLinear(kind, weight, torch.bfloat16, max_rows=4, dense_after_rows=20)
    x = torch.randn(8, 96).to(torch.bfloat16)
    kernel = torch.cat([layer(x[:4]), layer(x[4:])])  # 4 rows each: the kernel, and not counted
    assert layer._dense is None and layer._rows_past_max == 0
    for seen in (8, 16):  # 8 and 16 rows past max_rows: still the kernel, the same values as 4 rows at a time
        assert torch.equal(layer(x), kernel)
        assert layer._dense is None and layer._rows_past_max == seen
    dense = layer(x)  # 24 >= 20: the copy is made and used from now on
    assert layer._dense is not None and torch.equal(dense, layer.dense().forward(x))
    assert torch.equal(layer(x), dense) and layer._rows_past_max == 24
    assert torch.equal(torch.cat([layer(x[:4]), layer(x[4:])]), kernel)  # small steps stay on the kernel


def test_dense_copies_by_default_only_wait_for_int4_in_bfloat16_and_a_server_makes_them_all():
    data, ref = _gguf_weight("Q4_1", n=128, k=96)
    weight = unpack_gguf_blocks(data, "Q4_1", (128, 96))
    assert QuantLinear("int4", weight, torch.bfloat16).dense_after_rows == DENSE_AFTER_ROWS == 256
    assert QuantLinear("int4", weight, torch.float32).dense_after_rows == 0  # the kernel is ~30x slower there
    assert QuantLinear("int8", ref, torch.bfloat16).dense_after_rows == 0
    model = nn.Sequential(QuantLinear("int4", weight, torch.bfloat16), nn.ReLU(),
                          QuantLinear("int8", ref, torch.bfloat16))  # never run: only its layers are looked at
    assert make_dense_copies(model) == 2 and make_dense_copies(model) == 0
    assert all(m._dense is not None for m in model if isinstance(m, QuantLinear))


def test_float32_asked_by_name_is_the_precision_mode_where_blocks_could_run_in_float32(monkeypatch):
    """On an AVX2-only CPU the block kernel takes float32 activations (``--dtype auto``'s choice there), so
    ``--quantization auto`` under ``--dtype float32`` asked by name resolves to ``none``: every weight dequantized,
    as float32 is on every other CPU. ``--dtype auto``, other quantizations and other devices are left alone."""
    from goodserve.engine.args import resolve_quantization
    from goodserve.models import native

    monkeypatch.setattr(native, "blocks_run_in", lambda dtype: True)  # as on an AVX2-only CPU
    assert resolve_quantization("auto", "float32", "cpu") == "none"
    assert resolve_quantization("auto", "auto", "cpu") == "auto"
    assert resolve_quantization("auto", "bfloat16", "cpu") == "auto"
    assert resolve_quantization("int8", "float32", "cpu") == "int8"
    assert resolve_quantization("auto", "float32", "cuda:0") == "auto"
    monkeypatch.setattr(native, "blocks_run_in", lambda dtype: dtype == torch.bfloat16)  # AVX-512: dense float32
    assert resolve_quantization("auto", "float32", "cpu") == "auto"


def test_blocks_in_float32_run_decode_sized_steps_of_up_to_32_rows_on_the_kernel(monkeypatch):
    """Where ``auto`` runs blocks in float32 (an AVX2-only CPU), a block layer keeps steps of up to
    :data:`FLOAT32_BLOCKS_MAX_ROWS` rows on the kernel; in bfloat16, up to :data:`DEFAULT_MAX_ROWS`."""
    from goodserve.models import native

    if not native.block_gemv_usable(torch.empty(0)):
        pytest.skip("the block kernel is not built here")
    monkeypatch.setattr(native, "blocks_run_in", lambda dtype: True)
    data, _ = _gguf_weight("Q4_1", n=128, k=128)
    weight = unpack_gguf_blocks(data, "Q4_1", (128, 128))
    in_float32, in_bfloat16 = (make_linear(weight, None, dtype, "auto") for dtype in (torch.float32, torch.bfloat16))
    assert in_float32.kind == in_bfloat16.kind == "blocks"
    assert (in_float32.max_rows, in_bfloat16.max_rows) == (FLOAT32_BLOCKS_MAX_ROWS, DEFAULT_MAX_ROWS) == (32, 4)
    x = torch.randn(32, 128)
    assert torch.equal(in_float32(x), torch.cat([in_float32(x[i:i + 4]) for i in range(0, 32, 4)]))
    assert in_float32._dense is None and in_float32._rows_past_max == 0  # all 32 rows on the kernel


def test_make_linear_auto_keeps_4bit_blocks_only_in_bfloat16():
    data, ref = _gguf_weight("Q4_1", n=128)
    w = unpack_gguf_blocks(data, "Q4_1", (128, 96))
    assert isinstance(make_linear(w, None, torch.bfloat16, "auto"), QuantLinear)
    dense = make_linear(w, None, torch.float32, "auto")
    assert isinstance(dense, nn.Linear) and torch.equal(dense.weight, ref)
    q8 = unpack_gguf_blocks(_gguf_weight("Q8_0")[0], "Q8_0", (128, 96))
    assert not isinstance(make_linear(q8, None, torch.bfloat16, "auto"), QuantLinear)  # dense (prepacked)
    assert isinstance(make_linear(q8, None, torch.bfloat16, "int8"), QuantLinear)
    assert isinstance(make_linear(ref, None, torch.bfloat16, "int4"), QuantLinear)
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_linear(ref, None, torch.bfloat16, "int3")


def _stepwise_logits(weights, config, dtype, quantization, ids, attn=None):
    """Logits at every position of ``ids`` fed one token per step (the decode path: one row per step)."""
    from goodserve.models.attention import AttentionMetadata, TorchAttentionBackend
    from goodserve.models.llama import LlamaForCausalLM

    attn = attn or TorchAttentionBackend()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_weights(weights, dtype, quantization)
    block = 16
    shape = (4, block, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
              for _ in range(config.num_hidden_layers)]
    out = []
    with torch.inference_mode():
        for p, t in enumerate(ids):
            table = list(range(p // block + 1))
            meta = AttentionMetadata.build(block, [table], [p + 1], [], torch.tensor([p]), torch.device("cpu"),
                                           decode_groups=attn.uses_decode_groups)
            h = model(torch.tensor([t]), torch.tensor([p]), caches, meta, attn)
            out.append(model.compute_logits(h)[0])
    return torch.stack(out)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int4", "auto"])
def test_default_model_low_bit_logits_close_to_the_float32_dequantized_model(quantization):
    """Issue 15: the default model's Q4_1 blocks (and, under ``auto``, its Q8_0 LM head) as the file holds
    them, bfloat16 activations, against the same file dequantized to float32, on the 28 decode steps of a
    real prompt. ``int4`` is PyTorch's int4 kernel; ``auto`` is the native block kernel (int16 activations)
    through the one-call decode step, where the machine builds it, in ``--dtype auto``'s dtype: float32 on an
    AVX2-only CPU. Measured there (2026-12-08): 0.007 in float32; in bfloat16 1.38 with the native attention
    kernel and 0.95 with torch's, against 0.90 for dense bfloat16 (bfloat16's own rounding, which that CPU's
    users do not run).

    Documented tolerance: the low-bit path's largest logit error is at most 1.5x that of the dense bfloat16
    path (the file dequantized, then rounded to bfloat16) and below 5% of the largest logit; the greedy
    (argmax) token agrees with float32 at >= 90% of positions. Measured (2026-12-02): largest error 0.97
    (int4), 0.84 (auto) and 0.86 (bf16) on logits up to 32.7; argmax agreement 28/28 (int4), 26/28 (auto
    and bf16). (With int8 activations, llama.cpp's rounding, the block kernel's error was 2.1-2.3 and its
    agreement 24-27/28: hence int16.)"""
    from goodserve.engine.args import resolve_dtype
    from goodserve.models.attention import make_attention_backend
    from goodserve.models.loader import default_model_path, load_model
    from goodserve.runner.model_runner import DTYPES
    from tiny_models import smollm2_tokenizer

    loaded = load_model(default_model_path(), torch.float32, keep_quantized=True)
    ids = smollm2_tokenizer().encode("The quick brown fox jumps over the lazy dog. In 1969, the first humans "
                                     "walked on the Moon, and since then")[:40]
    ref = _stepwise_logits(loaded.weights, loaded.config, torch.float32, "none", ids)
    bf16 = _stepwise_logits(loaded.weights, loaded.config, torch.bfloat16, "none", ids)
    dtype = DTYPES[resolve_dtype("auto", "cpu")] if quantization == "auto" else torch.bfloat16
    low = _stepwise_logits(loaded.weights, loaded.config, dtype, quantization, ids,
                           make_attention_backend("auto", torch.device("cpu")))
    err_bf16, err_low = (bf16 - ref).abs().max(), (low - ref).abs().max()
    assert err_low <= 1.5 * err_bf16 and err_low <= 0.05 * ref.abs().max(), (err_bf16, err_low)
    agree = (low.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= 0.9, agree
