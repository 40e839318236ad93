"""The native block kernel (GGUF Q4_0/Q4_1/Q8_0 weights as the file holds them, int16 activations) and the
decode step that runs every layer in one call (issue 15, parts 1 and 2)."""

import pytest
import torch

from goodserve.config import ModelConfig
from goodserve.models import native
from goodserve.models.attention import AttentionMetadata, NativeAttentionBackend
from goodserve.models.llama import LlamaForCausalLM
from goodserve.models.quant import (BlockQuantized, QuantLinear, dequantize_rows, pack_blocks, quantize_int4,
                                    unpack_blocks)

pytestmark = pytest.mark.skipif(not native.block_gemv_usable(torch.empty(0)),
                                reason="the block kernel needs AVX-512 VNNI or AVX2 and a C++ compiler")


def _blocks(qtype: str, n: int, k: int, seed: int = 0) -> BlockQuantized:
    """A random weight in ``qtype`` blocks whose scales and minimums are fp16 values, as in a file."""
    torch.manual_seed(seed)
    w = torch.randn(n, k) * 0.05
    if qtype == "Q8_0":
        d = (w.view(n, k // 32, 32).abs().amax(-1) / 127).half().float()
        q = (w.view(n, k // 32, 32) / d[..., None]).round().clamp(-127, 127).to(torch.int8).view(n, k)
        return BlockQuantized("Q8_0", q, d)
    b = quantize_int4(w)
    return BlockQuantized(qtype, b.q, b.scales.half().float(), None if qtype == "Q4_0" else b.mins.half().float())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_block_gemv_matches_the_float64_product(qtype, rows):
    """Float32 in and out: the only rounding is the activations' to int16 per block of 32 (2^-15 of the
    block's largest value) and float32 sums, so the error is ~1e-5 of the largest output."""
    weight = _blocks(qtype, 96, 1536, seed=rows)
    layer = QuantLinear("blocks", weight, torch.float32, max_rows=8)
    x = torch.randn(rows, 1536)
    want = x.double() @ weight.dequantize().double().t()
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-4


def test_block_gemv_in_bfloat16_rounds_only_its_output():
    weight = _blocks("Q4_1", 576, 576)
    x = torch.randn(2, 640).bfloat16()[:, :576]  # a row stride, as a slice of a wider output
    got = QuantLinear("blocks", weight, torch.bfloat16)(x)
    want = x.double() @ weight.dequantize().double().t()
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= 2 ** -8 * want.abs() + 1e-4 * want.abs().max()).all()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_packed_blocks_are_the_files_values(qtype):
    weight = _blocks(qtype, 64, 128)
    codes, scales, mins, offset = pack_blocks(weight)
    back = unpack_blocks(qtype, codes, scales, mins)
    assert torch.equal(back.q, weight.q) and torch.equal(back.scales, weight.scales)
    assert (back.mins is None) == (weight.mins is None) and (mins is None or torch.equal(back.mins, weight.mins))
    assert offset == {"Q4_0": 8, "Q4_1": 0, "Q8_0": 128}[qtype]
    # Steps of more rows run on a dense copy made from the same codes: the dequantized file, rounded once.
    layer = QuantLinear("blocks", weight, torch.bfloat16)
    assert torch.equal(layer.dense_weight(), dequantize_rows(weight, torch.bfloat16))


def test_block_gemv_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="multiple of 64"):
        QuantLinear("blocks", _blocks("Q4_1", 64, 96), torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        QuantLinear("blocks", _blocks("Q8_0", 24, 128), torch.bfloat16)
    weight = _blocks("Q4_1", 64, 128)
    codes, scales, mins, offset = pack_blocks(weight)
    with pytest.raises(ValueError, match=r"\[rows, 128\]"):
        native.block_gemv(torch.randn(1, 64), "Q4_1", codes, scales, mins, offset, torch.float32)
    with pytest.raises(ValueError, match=r"\[rows, 128\]"):
        native.block_gemv(torch.randn(2, 128).double(), "Q4_1", codes, scales, mins, offset, torch.float32)


def _config(bias: bool = False, qk_norm: bool = False) -> ModelConfig:
    return ModelConfig(architecture="qwen3" if qk_norm else "llama", qk_norm=qk_norm, vocab_size=512, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
                       tie_word_embeddings=True, attention_bias=bias)


def _weights(c: ModelConfig, qtype: str = "Q4_1") -> dict:
    """HF-named weights: the projections in ``qtype`` blocks, the (tied) embedding in Q8_0."""
    torch.manual_seed(0)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    w = {"model.embed_tokens.weight": _blocks("Q8_0", c.vocab_size, c.hidden_size),
         "model.norm.weight": 1 + 0.1 * torch.randn(c.hidden_size)}
    shapes = {"self_attn.q_proj": (q, c.hidden_size), "self_attn.k_proj": (kv, c.hidden_size),
              "self_attn.v_proj": (kv, c.hidden_size), "self_attn.o_proj": (c.hidden_size, q),
              "mlp.gate_proj": (c.intermediate_size, c.hidden_size), "mlp.up_proj": (c.intermediate_size, c.hidden_size),
              "mlp.down_proj": (c.hidden_size, c.intermediate_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for j, (name, shape) in enumerate(shapes.items()):
            w[p + name + ".weight"] = _blocks(qtype, *shape, seed=100 * i + j)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[p + norm + ".weight"] = 1 + 0.1 * torch.randn(c.hidden_size)
        if c.qk_norm:
            for norm in ("q_norm", "k_norm"):
                w[p + f"self_attn.{norm}.weight"] = 1 + 0.1 * torch.randn(c.head_dim)
        if c.attention_bias:
            for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                w[p + f"self_attn.{name}.bias"] = 0.1 * torch.randn(n)
    return w


def _model(c: ModelConfig, weights: dict, dtype=torch.bfloat16, quantization: str = "auto") -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(c)
    model.load_weights(weights, dtype, quantization)
    return model


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_decode_step_in_one_call_equals_the_layer_by_layer_path(qtype):
    """Six requests prefill on the eager path, then decode 5 steps (6 rows, then 1): every step's hidden
    states and KV writes from the one-call decode step equal the layer-by-layer path on the same kernels
    (up to SiLU's exp, which may round an activation one bfloat16 step apart: none did here)."""
    c = _config()
    model = _model(c, _weights(c, qtype))
    assert model.decode_plan is not None
    assert model.lm_head.kind == "blocks" and model.lm_head.qtype == "Q8_0"
    decode_both_ways(model, c)


def test_qwen3_decode_step_in_one_call_equals_the_layer_by_layer_path():
    """Qwen3's q/k norms (each head normed before RoPE, ``native.head_rms_norm``) in the one-call step: the
    same hidden states and KV writes as the layer-by-layer path."""
    c = _config(qk_norm=True)
    model = _model(c, _weights(c))
    assert model.decode_plan is not None and model.layers[0].qk_norm is not None
    decode_both_ways(model, c)


def test_head_rms_norm_is_each_heads_rms_norm():
    """``native.head_rms_norm`` on a strided ``[rows, heads, head_dim]`` view (q and k inside a fused qkv row)
    against HF's RMSNorm per head (float32 within its rounding of the sum of squares), and its refusals."""
    from goodserve.models.llama import _rms_norm

    qkv = torch.randn(5, 12 * 32)
    qk = qkv[:, :10 * 32].view(5, 10, 32)
    w = 1 + 0.1 * torch.randn(10, 32)
    got = native.head_rms_norm(qk, w, 1e-6)
    assert got.shape == (5, 10, 32) and got.is_contiguous()
    assert torch.allclose(got, _rms_norm(qk, w, 1e-6), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"weight must be \[10, 32\]"):
        native.head_rms_norm(qk, w[:9], 1e-6)
    with pytest.raises(ValueError, match="heads contiguous"):
        native.head_rms_norm(qk.transpose(1, 2), w, 1e-6)


def decode_both_ways(model: LlamaForCausalLM, c: ModelConfig) -> None:
    """Prefill six requests, then decode 5 steps (6 rows, then 1) with the one-call decode step and with the
    layer-by-layer path into two caches; assert every step's hidden states and the caches are equal."""
    attn, bs = NativeAttentionBackend(), 4
    shape = (32, bs, c.num_key_value_heads, c.head_dim)
    caches = {flag: [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
                     for _ in range(c.num_hidden_layers)] for flag in (True, False)}
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(6)]
    prompts = [[5, 9, 11, 3, 7], [1, 2], [8] * 9, [4], [7, 7, 1], [2, 3, 5, 7, 11, 13]]
    torch.manual_seed(1)
    with torch.inference_mode():
        for flag in (True, False):  # the same prefill into both caches
            for table, ids in zip(tables, prompts):
                n = len(ids)
                slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
                meta = AttentionMetadata.build(bs, [], [], [(0, n, table)], slots, torch.device("cpu"), decode_groups=False)
                model(torch.tensor(ids), torch.arange(n), caches[flag], meta, attn)
        lens = [len(p) for p in prompts]
        for step in range(5):
            live = list(range(6)) if step < 3 else [1]
            order = sorted(live, key=lambda i: lens[i])  # decodes sorted by context, as the runner lays them out
            ids = torch.tensor([step + 10 * i for i in order])
            positions = torch.tensor([lens[i] for i in order])
            slots = torch.tensor([tables[i][lens[i] // bs] * bs + lens[i] % bs for i in order])
            meta = AttentionMetadata.build(bs, [tables[i][:lens[i] // bs + 1] for i in order],
                                           [lens[i] + 1 for i in order], [], slots, torch.device("cpu"),
                                           decode_groups=False)
            out = {}
            assert model.can_decode_in_one_call(len(order), meta, attn)
            out[True] = model.decode_in_one_call(ids, positions, caches[True], meta, attn)
            out[False] = model(ids, positions, caches[False], meta, attn)
            assert torch.equal(out[True], out[False]), step
            for i in order:
                lens[i] += 1
    for (k1, v1), (k2, v2) in zip(caches[True], caches[False]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_the_decode_plan_needs_every_projection_on_the_block_kernel():
    c = _config()
    weights = _weights(c)
    assert _model(c, weights).decode_plan is not None
    assert _model(c, weights, quantization="none").decode_plan is None  # dense bfloat16
    assert _model(c, weights, quantization="int4").decode_plan is None  # PyTorch's int4 kernel
    # auto keeps float32 dense, except where float32 is --dtype auto's choice (no fast bfloat16 path)
    assert (_model(c, weights, dtype=torch.float32).decode_plan is None) != native.blocks_run_in(torch.float32)
    biased = _config(bias=True)
    assert _model(biased, _weights(biased)).decode_plan is None  # q/k/v bias (Qwen2)


def test_a_nan_activation_makes_every_output_it_feeds_nan():
    """max() drops NaN: without the check, a NaN in a block quantized to -32768 and came out finite."""
    weight = _blocks("Q4_1", 16, 128)
    layer = QuantLinear("blocks", weight, torch.float32)
    for k in (0, 5, 16, 31, 100):
        x = torch.randn(2, 128)
        x[1, k] = float("nan")
        y = layer(x)
        assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all(), k


def test_the_decode_step_refuses_caches_it_was_not_built_for():
    c = _config()
    model = _model(c, _weights(c))
    shape = (8, 4, c.num_key_value_heads, c.head_dim)
    caches = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
              for _ in range(c.num_hidden_layers)]
    plan = model.decode_plan
    k, v = plan.cache_addresses(caches)
    assert k.tolist() == [p[0].data_ptr() for p in caches] and v.tolist() == [p[1].data_ptr() for p in caches]
    with pytest.raises(ValueError, match="pairs of contiguous"):
        plan.cache_addresses(caches[:-1])
    with pytest.raises(ValueError, match="pairs of contiguous"):
        plan.cache_addresses(caches[:-1] + [(caches[0][0].float(), caches[0][1].float())])
