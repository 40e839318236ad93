"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept as blocks and multiplied on the native block kernel (issue 32, item 1)."""

import numpy as np
import pytest
import torch

from goodserve.config import ModelConfig
from goodserve.models import native
from goodserve.models.kquant import (HIGH_BITS, KQUANT_OFFSETS, KQUANT_TYPES, KQuantized, pack_codes, unpack_codes,
                                     unpack_gguf_kquant)
from goodserve.models.quant import QuantLinear, dequantize_rows, make_linear, pack_blocks, unpack_blocks

_FILE_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
needs_kernel = pytest.mark.skipif(not native.block_gemv_usable(torch.empty(0)),
                                  reason="the block kernel needs AVX-512 VNNI and a C++ compiler")


def _scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12 bytes of 8 six-bit scales and minimums (the inverse of ggml-quants.c's get_scale_min_k4)."""
    lo = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    mid = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    hi = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return np.concatenate([lo, mid, hi], axis=-1).astype(np.uint8)


def kquant_bytes(qtype: str, n: int, k: int, seed: int = 0, centered: bool = False) -> np.ndarray:
    """``[n, bytes per row]`` uint8 of a ``qtype`` tensor: random codes and sub-block scales, fp16 super-block
    scales (finite, either sign). ``centered``: positive scales, and minimums set as a quantizer sets them for
    weights centred on 0 (``dmin * m ~ d * sc * q_max / 2``), so the rows' products do not cancel."""
    rng = np.random.default_rng(seed)
    sb = k // 256
    blocks = rng.integers(0, 256, size=(n, sb, _FILE_BYTES[qtype]), dtype=np.uint8)
    lo, hi = (1e-3, 2e-3) if centered else (-0.02, 0.02)
    d = rng.uniform(lo, hi, size=(n, sb)).astype(np.float16)
    if qtype == "Q6_K":
        blocks[..., 208:210] = d[..., None].view(np.uint8)
        return blocks.reshape(n, -1)
    dmin = rng.uniform(lo, hi, size=(n, sb)).astype(np.float16)
    if centered:
        qmax = 15 if qtype == "Q4_K" else 31
        dmin = d * np.float16(16 if qtype == "Q4_K" else 32)  # exact: a power of two
        sc = rng.integers(32, 64, size=(n, sb, 8)).astype(np.uint8)
        mn = np.round(sc * (qmax / 2) / (16 if qtype == "Q4_K" else 32)).astype(np.uint8)
        blocks[..., 4:16] = _scales_k4(sc, mn)
    blocks[..., 0:2] = d[..., None].view(np.uint8)
    blocks[..., 2:4] = dmin[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("qtype", KQUANT_TYPES)
@pytest.mark.parametrize("n,k", [(16, 256), (48, 512), (32, 1536), (8, 2304)])
def test_unpacked_kquants_dequantize_exactly_as_gguf(qtype, n, k):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = kquant_bytes(qtype, n, k, seed=n + k)
    want = dequantize(data, GGMLQuantizationType[qtype]).reshape(n, k)
    weight = unpack_gguf_kquant(data, qtype, (n, k))
    assert isinstance(weight, KQuantized) and weight.shape == (n, k)
    got = weight.dequantize()
    assert got.dtype == torch.float32 and np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
    # In thousand-row pieces (the dense copy, the embedding lookup) the same values.
    assert torch.equal(dequantize_rows(weight, torch.float32, rows=5), got)
    # Bytes held: the codes' bits per weight, 8-bit sub-block scales, fp16 super-block scales.
    held = sum(t.numel() * t.element_size() for t in (weight.q, weight.scales, weight.mins))
    assert held * 8 / (n * k) == {"Q4_K": 4.625, "Q5_K": 5.625, "Q6_K": 6.5625}[qtype]


@pytest.mark.parametrize("high_bits", [0, 1, 2])
def test_codes_pack_and_unpack_back(high_bits):
    q = np.random.default_rng(high_bits).integers(0, 16 << high_bits, size=(6, 512), dtype=np.uint8)
    packed = pack_codes(q, high_bits)
    assert packed.shape == (6, 512 * (4 + high_bits) // 8)
    # Byte j of a block's nibbles: weight j low, j + 16 high; plane bit 0 is block 0's weight 0, bit 16 block 1's.
    assert packed[0, 0] == (q[0, 0] & 15) | ((q[0, 16] & 15) << 4)
    assert packed[0, 16] == (q[0, 32] & 15) | ((q[0, 48] & 15) << 4)
    if high_bits:
        plane = int.from_bytes(packed[0, 32:40].tobytes(), "little")
        assert [plane >> i & 1 for i in (0, 16, 32, 48)] == [q[0, j] >> 4 & 1 for j in (0, 32, 16, 48)]
    assert torch.equal(unpack_codes(torch.from_numpy(packed), 512, high_bits), torch.from_numpy(q))


def test_unpack_refuses_wrong_sizes_and_types():
    data = kquant_bytes("Q4_K", 4, 512)
    with pytest.raises(ValueError, match="does not hold"):
        unpack_gguf_kquant(data, "Q4_K", (4, 256))
    with pytest.raises(ValueError, match="no K-quant layout"):
        unpack_gguf_kquant(data, "Q3_K", (4, 512))


@pytest.mark.parametrize("qtype", KQUANT_TYPES)
def test_kernel_operands_are_the_blocks_and_rows_permute_split_and_fuse(qtype):
    weight = unpack_gguf_kquant(kquant_bytes(qtype, 32, 512), qtype, (32, 512))
    codes, scales, mins, offset = pack_blocks(weight)
    assert offset == KQUANT_OFFSETS[qtype] == {"Q4_K": 0, "Q5_K": 0, "Q6_K": 32}[qtype]
    assert torch.equal(unpack_blocks(qtype, codes, scales, mins).dequantize(), weight.dequantize())
    native.check_blocks(qtype, codes, scales, mins)
    dense = weight.dequantize()
    index = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(weight.permute_rows(index).dequantize(), dense[index])
    top, bottom = weight.split_rows([16, 16])
    assert type(top) is KQuantized and torch.equal(bottom.dequantize(), dense[16:])
    assert torch.equal(KQuantized.cat([bottom, top]).dequantize(), torch.cat([dense[16:], dense[:16]]))
    assert HIGH_BITS[qtype] == {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}[qtype]
    with pytest.raises(ValueError, match="operands do not hold"):
        native.check_blocks(qtype, codes, scales, mins.view(torch.int8 if qtype != "Q6_K" else torch.uint8))


@needs_kernel
@pytest.mark.parametrize("qtype", KQUANT_TYPES)
@pytest.mark.parametrize("k", [256, 512, 1536, 2304])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_gemv_on_kquants_matches_the_float64_product(qtype, k, dtype):
    """Float32 out: the only rounding is the activations' to int16 per block of 32 (2^-15 of the block's
    largest value) and float32 sums: within 1e-4 of the largest output, for 1-5 rows (5: two passes)."""
    for n in (16, 48):
        weight = unpack_gguf_kquant(kquant_bytes(qtype, n, k, seed=k + n, centered=True), qtype, (n, k))
        codes, scales, mins, offset = pack_blocks(weight)
        w64 = weight.dequantize().double()
        for rows in range(1, 6):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
            got = native.block_gemv(x, qtype, codes, scales, mins, offset, torch.float32)
            want = x.double() @ w64.t()
            assert got.shape == (rows, n)
            assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-4, (n, rows)


@needs_kernel
@pytest.mark.parametrize("qtype", KQUANT_TYPES)
def test_kquant_layer_runs_small_steps_on_the_kernel_and_nan_reaches_its_outputs(qtype):
    weight = unpack_gguf_kquant(kquant_bytes(qtype, 32, 512, centered=True), qtype, (32, 512))
    layer = make_linear(weight, None, torch.bfloat16, "auto")
    assert isinstance(layer, QuantLinear) and layer.kind == "blocks" and layer.qtype == qtype
    assert torch.equal(layer.dense_weight(), dequantize_rows(weight, torch.bfloat16))
    assert not isinstance(make_linear(weight, None, torch.float32, "auto"), QuantLinear)  # float32: dense
    x = torch.randn(2, 512)
    x[1, 40] = float("nan")
    y = QuantLinear("blocks", weight, torch.float32)(x)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()
    with pytest.raises(ValueError, match=r"\[rows, 512\]"):
        native.block_gemv(torch.randn(1, 256), qtype, layer.packed, layer.extra, layer.mins, layer.offset,
                          torch.float32)


def _kquant_config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
                       tie_word_embeddings=True)


@needs_kernel
def test_decode_step_in_one_call_runs_kquant_projections():
    """Every projection a K-quant (one type per fused matrix: q/k/v Q4_K, o Q5_K, gate/up Q4_K, down Q6_K)
    and the tied head Q6_K: the one-call decode step equals the layer-by-layer path, as for Q4_1."""
    from test_block_gemv import _model, decode_both_ways

    c = _kquant_config()
    torch.manual_seed(0)
    types = {"self_attn.q_proj": ("Q4_K", 256, 256), "self_attn.k_proj": ("Q4_K", 128, 256),
             "self_attn.v_proj": ("Q4_K", 128, 256), "self_attn.o_proj": ("Q5_K", 256, 256),
             "mlp.gate_proj": ("Q4_K", 512, 256), "mlp.up_proj": ("Q4_K", 512, 256),
             "mlp.down_proj": ("Q6_K", 256, 512)}
    w = {"model.embed_tokens.weight": unpack_gguf_kquant(kquant_bytes("Q6_K", 512, 256, 1), "Q6_K", (512, 256)),
         "model.norm.weight": 1 + 0.1 * torch.randn(256)}
    for i in range(2):
        p = f"model.layers.{i}."
        for j, (name, (qtype, n, k)) in enumerate(types.items()):
            data = kquant_bytes(qtype, n, k, seed=10 * i + j, centered=True)
            w[p + name + ".weight"] = unpack_gguf_kquant(data, qtype, (n, k))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[p + norm + ".weight"] = 1 + 0.1 * torch.randn(256)
    model = _model(c, w)
    assert model.decode_plan is not None
    assert [p.qtype for p in (model.layers[0].qkv_proj, model.layers[0].o_proj, model.layers[0].down_proj,
                              model.lm_head)] == ["Q4_K", "Q5_K", "Q6_K", "Q6_K"]
    decode_both_ways(model, c)
