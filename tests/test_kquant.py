"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept as blocks and multiplied on the native block kernel (issue 32, item 1)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from goodserve.config import ModelConfig
from goodserve.models import native
from goodserve.models.kquant import (HIGH_BITS, KQUANT_OFFSETS, KQUANT_TYPES, KQuantized, pack_codes, unpack_codes,
                                     unpack_gguf_kquant)
from goodserve.models.quant import QuantLinear, dequantize_rows, make_linear, pack_blocks, unpack_blocks

TINY_Q4_K_M = str(Path(__file__).parent / "data" / "tiny-llama-q4_k_m.gguf")
_FILE_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
needs_kernel = pytest.mark.skipif(not native.block_gemv_usable(torch.empty(0)),
                                  reason="the block kernel needs AVX-512 VNNI or AVX2 and a C++ compiler")


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


def check_dequantizes_as_gguf(data: np.ndarray, qtype: str, shape: tuple[int, int], weight, cls) -> None:
    """``weight`` (unpacked from ``data``) is a ``cls`` of ``shape`` whose dequantization equals
    ``gguf.quants.dequantize`` bit for bit, whole and in row pieces (the dense copy, the embedding lookup;
    also used by test_q5)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    want = dequantize(data, GGMLQuantizationType[qtype]).reshape(shape)
    assert isinstance(weight, cls) and weight.shape == shape
    got = weight.dequantize()
    assert got.dtype == torch.float32 and np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
    assert torch.equal(dequantize_rows(weight, torch.float32, rows=5), got)


@pytest.mark.parametrize("qtype", KQUANT_TYPES)
@pytest.mark.parametrize("n,k", [(16, 256), (48, 512), (32, 1536), (8, 2304)])
def test_unpacked_kquants_dequantize_exactly_as_gguf(qtype, n, k):
    data = kquant_bytes(qtype, n, k, seed=n + k)
    weight = unpack_gguf_kquant(data, qtype, (n, k))
    check_dequantizes_as_gguf(data, qtype, (n, k), weight, KQuantized)
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
    check_products_match_float64(
        lambda n: unpack_gguf_kquant(kquant_bytes(qtype, n, k, seed=k + n, centered=True), qtype, (n, k)),
        qtype, k, dtype)


def check_products_match_float64(weight_of, qtype: str, k: int, dtype: torch.dtype) -> None:
    """Float32 out: the only rounding is the activations' to int16 per block of 32 (2^-15 of the block's
    largest value) and float32 sums: within 1e-4 of the largest output, for 1-5 rows (5: two passes), for the
    weights ``weight_of(n)`` (``[n, k]``) of 16 and 48 rows (also used by test_q5)."""
    for n in (16, 48):
        weight = weight_of(n)
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
    layer = check_blocks_layer(weight, qtype)
    with pytest.raises(ValueError, match=r"\[rows, 512\]"):
        native.block_gemv(torch.randn(1, 256), qtype, layer.packed, layer.extra, layer.mins, layer.offset,
                          torch.float32)



def check_blocks_layer(weight, qtype: str) -> QuantLinear:
    """A ``[32, 512]`` block weight under ``--quantization auto``: a blocks layer in bfloat16 whose dense copy
    is the dequantized weight, dense in float32, and a NaN in one row of the input reaches that row only
    (also used by test_q5). Returns the bfloat16 layer."""
    layer = make_linear(weight, None, torch.bfloat16, "auto")
    assert isinstance(layer, QuantLinear) and layer.kind == "blocks" and layer.qtype == qtype
    assert torch.equal(layer.dense_weight(), dequantize_rows(weight, torch.bfloat16))
    # float32: dense, but on a CPU without a fast bfloat16 path, where float32 is --dtype auto's choice
    in_float32 = make_linear(weight, None, torch.float32, "auto")
    assert isinstance(in_float32, QuantLinear) == native.blocks_run_in(torch.float32)
    x = torch.randn(2, 512)
    x[1, 40] = float("nan")
    y = QuantLinear("blocks", weight, torch.float32)(x)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()
    return layer

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


def test_q4_k_m_file_keeps_its_kquants_as_blocks():
    """``tests/data/tiny-llama-q4_k_m.gguf`` (llama-quantize Q4_K_M, ``attn_output`` forced to Q5_K: see
    ``tests/data/README.md``): every 2-D weight kept as the file's K-quant blocks, values equal to the dense
    load's (gguf's dequantization); the mix as llama.cpp chose it (Q6_K for the tied embedding and for the
    second layer's ``attn_v`` / ``ffn_down``)."""
    from goodserve.models.gguf_file import tensor_type_mix
    from goodserve.models.gguf_reader import GGUFFile
    from goodserve.models.loader import load_model

    assert tensor_type_mix(GGUFFile(TINY_Q4_K_M).tensors) == "Q4_K ×10, F32 ×5, Q6_K ×3, Q5_K ×2"
    blocks = load_model(TINY_Q4_K_M, torch.float32, keep_quantized=True).weights
    dense = load_model(TINY_Q4_K_M, torch.float32).weights
    kinds = {name: w.qtype for name, w in blocks.items() if isinstance(w, KQuantized)}
    assert kinds["model.embed_tokens.weight"] == "Q6_K"
    assert kinds["model.layers.1.self_attn.v_proj.weight"] == kinds["model.layers.1.mlp.down_proj.weight"] == "Q6_K"
    assert kinds["model.layers.0.self_attn.v_proj.weight"] == kinds["model.layers.0.mlp.down_proj.weight"] == "Q4_K"
    assert {kinds[f"model.layers.{i}.self_attn.o_proj.weight"] for i in range(2)} == {"Q5_K"}
    assert len(kinds) == 15 and set(blocks) == set(dense)
    for name, qtype in kinds.items():
        assert torch.equal(blocks[name].dequantize(), dense[name]), name


@needs_kernel
def test_mixed_type_fused_projection_runs_a_block_layer_per_part_in_the_one_call_step_too():
    """Layer 1's q/k/v are Q4_K, Q4_K and Q6_K: one block layer each (not one dense bfloat16 matrix), their
    outputs side by side, and the one-call decode step runs them as parts of one projection, equal to the
    layer-by-layer path."""
    from goodserve.models.kquant import PartsLinear
    from goodserve.models.loader import load_model
    from test_block_gemv import _model, decode_both_ways

    loaded = load_model(TINY_Q4_K_M, torch.bfloat16, keep_quantized=True)
    model = _model(loaded.config, loaded.weights)
    assert model.decode_plan is not None
    assert model.decode_plan.layer_ints[1, :9].tolist() == [2, 0, 256, 2, 0, 128, 4, 32, 128]  # kind, offset, rows
    assert isinstance(model.layers[0].qkv_proj, QuantLinear) and model.layers[0].qkv_proj.qtype == "Q4_K"
    qkv = model.layers[1].qkv_proj
    assert isinstance(qkv, PartsLinear) and [p.qtype for p in qkv.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    assert model.lm_head.qtype == "Q6_K" and model.layers[1].down_proj.qtype == "Q6_K"
    a = "model.layers.1.self_attn."
    dense = torch.cat([load_model(TINY_Q4_K_M, torch.float32).weights[a + n + "_proj.weight"] for n in "qkv"])
    x = torch.randn(3, 256).bfloat16()
    want = x.double() @ dense.double().t()
    assert ((qkv(x).double() - want).abs() <= 2 ** -8 * want.abs() + 1e-4 * want.abs().max()).all()
    decode_both_ways(model, loaded.config)


@needs_kernel
def test_q4_k_m_file_greedy_tokens_equal_the_float32_dense_run():
    """The file served under ``--quantization auto`` in bfloat16 (K-quant blocks on the block kernel, the
    tied Q6_K head too; the second layer's q/k/v mix Q4_K and Q6_K and run as three block layers, in the
    one-call decode step as parts of one projection) against the file dequantized to float32, eight prompts
    batched.

    Measured (2026-12-04) on ten prompts of this family: the two runs' logprobs of the chosen tokens
    differed by at most 0.25 (the file dequantized to a dense bfloat16 run: 0.20); the two prompts left out
    (lengths 3 and 40) are those whose greedy tokens flipped, at float32 top-2 logit margins of 0.30 and
    0.09: near ties within bfloat16's error, which the dense bfloat16 run flips as well."""
    check_greedy_equals_dense_float32(TINY_Q4_K_M, left_out=3)


def check_greedy_equals_dense_float32(path: str, left_out: int) -> None:
    """The GGUF at ``path`` under ``--dtype auto`` and ``--quantization auto`` (bfloat16; float32 on an AVX2-only
    CPU, whose blocks run in float32) gives the greedy tokens of the same file dequantized to float32, for this
    family of prompts but the one of ``left_out`` tokens (a near tie in bfloat16; also used by test_q5)."""
    from goodserve import LLM, SamplingParams

    prompts = [[100 + (7 * i + 3 * j) % 400 for j in range(n)] for i, n in enumerate((5, 17, 33, 48, 3, 9, 12, 25, 7))
               if n != left_out]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = {}
    for dtype, quantization in (("float32", "none"), ("auto", "auto")):
        llm = LLM(path, dtype=dtype, quantization=quantization, block_size=4, num_blocks=256,
                  log_stats_interval=0)
        model = llm.engine.core.runner.model
        assert (quantization == "auto") == any(isinstance(m, QuantLinear) for m in model.modules())
        runs[quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert runs["auto"] == runs["none"]
    assert len({t for ids in runs["none"] for t in ids}) > 10  # not one token repeated
