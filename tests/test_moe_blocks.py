"""A GGUF mixture of experts' quantized experts kept as blocks on the native block kernel (issue 32, item 3)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from goodserve.bench.random_gguf import RandomShape, write_random_gguf
from goodserve.models import moe_blocks
from goodserve.models.moe import grouped_experts, route
from goodserve.models.moe_blocks import BlockExperts, StackedBlocks, unpack_gguf_experts
from test_kquant import check_greedy_equals_dense_float32, kquant_bytes, needs_kernel

E, HIDDEN, INTER = 8, 256, 64  # K-quants need rows of 256 weights: hidden 256 (gate/up), width 256 (down)


def expert_bytes(qtype: str, e: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """``[e, n, bytes per row]`` uint8 of a 3-D ``qtype`` expert tensor: ``gguf.quants.quantize`` of
    ``N(0, 1/k)`` weights for the types it writes, random codes and scales (``kquant_bytes``) for the K-quants."""
    import gguf
    from gguf.quants import quantize

    if qtype.endswith("_K"):
        return kquant_bytes(qtype, e * n, k, seed=seed, centered=True).reshape(e, n, -1)
    w = np.random.default_rng(seed).standard_normal((e, n, k), dtype=np.float32) * k ** -0.5
    return quantize(w, gguf.GGMLQuantizationType[qtype])


def dequantized(data: np.ndarray, qtype: str, shape: tuple[int, int, int]) -> torch.Tensor:
    """``gguf.quants.dequantize`` of the whole 3-D tensor: ``[E, N, K]`` float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(data, GGMLQuantizationType[qtype]).reshape(shape).copy())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_unpacked_experts_dequantize_exactly_as_gguf(qtype):
    """Each expert cut from the 3-D tensor dequantizes bit for bit as ``gguf.quants`` dequantizes the whole
    tensor; gate and up fuse per expert (rows gate then up)."""
    k = 512
    data = expert_bytes(qtype, 4, 32, k)
    stacked = unpack_gguf_experts(data, qtype, (4, 32, k))
    want = dequantized(data, qtype, (4, 32, k))
    assert stacked.shape == (4, 32, k) and stacked.qtype == qtype
    got = stacked.dequantize(torch.float32)
    assert np.array_equal(got.numpy().view(np.uint32), want.numpy().view(np.uint32))
    assert torch.equal(stacked.dequantize(torch.bfloat16), want.to(torch.bfloat16))
    fused = StackedBlocks.cat_rows([stacked, stacked])
    assert fused.shape == (4, 64, k) and torch.equal(fused.dequantize(torch.float32), torch.cat([want, want], dim=1))
    assert stacked.nbytes == data.size if qtype in ("Q4_0", "Q8_0") else stacked.nbytes > 0


def test_unpack_refuses_wrong_types_and_sizes():
    data = expert_bytes("Q4_0", 4, 32, 256)
    with pytest.raises(ValueError, match="no block layout for GGUF type IQ4_NL"):
        unpack_gguf_experts(data, "IQ4_NL", (4, 32, 256))
    with pytest.raises(ValueError, match=r"does not hold a \[32, 512\] weight"):
        unpack_gguf_experts(data, "Q4_0", (4, 32, 512))
    with pytest.raises(ValueError, match="does not hold 5 experts"):
        unpack_gguf_experts(data, "Q4_0", (5, 32, 256))
    q8 = unpack_gguf_experts(expert_bytes("Q8_0", 4, 32, 256), "Q8_0", (4, 32, 256))
    with pytest.raises(ValueError, match="cannot fuse experts of different types"):
        StackedBlocks.cat_rows([unpack_gguf_experts(data, "Q4_0", (4, 32, 256)), q8])


def _layer(qtypes: tuple[str, str, str], seed: int = 0):
    """Gate, up and down experts (``E`` experts, hidden ``HIDDEN``, width 256 for the K-quants' down rows else
    ``INTER``) of the given types: the :class:`StackedBlocks` and the dequantized ``[E, 2I, H]`` / ``[E, H, I]``."""
    inter = 256 if qtypes[2].endswith("_K") else INTER
    shapes = [(E, inter, HIDDEN), (E, inter, HIDDEN), (E, HIDDEN, inter)]
    parts, dense = [], []
    for i, (qtype, shape) in enumerate(zip(qtypes, shapes)):
        data = expert_bytes(qtype, *shape, seed=seed + i)
        parts.append(unpack_gguf_experts(data, qtype, shape))
        dense.append(dequantized(data, qtype, shape))
    gate_up = [StackedBlocks.cat_rows(parts[:2])] if qtypes[0] == qtypes[1] else parts[:2]
    return gate_up, parts[2], torch.cat(dense[:2], dim=1), dense[2]


def _routing(n: int, num_experts: int = E, top_k: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed + n)
    x = torch.randn(n, HIDDEN, generator=g)
    weights, experts = route(torch.randn(n, num_experts, generator=g) * 3, top_k, True)
    return x, weights, experts


@needs_kernel
@pytest.mark.parametrize("qtypes", [("Q4_0",) * 3, ("Q4_1",) * 3, ("Q8_0",) * 3, ("Q4_K", "Q4_K", "Q6_K"),
                                    ("Q4_0", "Q8_0", "Q4_1")])
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_block_experts_equal_the_dense_grouped_experts(qtypes, num_tokens):
    """Float32 activations on the kernel only (no dense copy): within 1e-4 of the largest output of the float64
    product on the dequantized weights, as the dense grouped computation is (the kernel rounds the
    activations to int16 per block of 32); gate and up of two types run as two parts. In bfloat16 within
    bfloat16's rounding of the dense bfloat16 run."""
    gate_up, down, gate_up_w, down_w = _layer(qtypes)
    x, weights, experts = _routing(num_tokens)
    want = grouped_experts(x.double(), weights.double(), experts, gate_up_w.double(), down_w.double(), torch.float64)
    dense = grouped_experts(x, weights, experts, gate_up_w, down_w, torch.float32)
    layer = BlockExperts(gate_up, down, torch.float32, dense_after_rows=10 ** 9)
    from goodserve.models.moe import grouped_by_expert

    got = grouped_by_expert(x, weights, experts, E, layer.run_sorted, torch.float32)
    scale = want.abs().max()
    assert got.shape == (num_tokens, HIDDEN) and got.dtype == torch.float32
    assert ((got.double() - want).abs().max() / scale).item() < 1e-4
    assert ((dense.double() - want).abs().max() / scale).item() < 1e-5
    assert layer.dense_copies() == 0
    bf16 = BlockExperts(gate_up, down, torch.bfloat16)
    got16 = grouped_by_expert(x.bfloat16(), weights.bfloat16(), experts, E, bf16.run_sorted, torch.bfloat16)
    assert got16.dtype == torch.bfloat16 and ((got16.double() - want).abs().max() / scale).item() < 2e-2


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_kernel_equals_block_gemv_per_expert_bit_for_bit(qtype, dtype):
    """``block_gemv_grouped`` is ``block_gemv`` of each group's expert over its rows, bit for bit: groups of 1,
    6 (two passes: 4 + 2) and 3 rows, in no expert order; the row in no group is zero."""
    from goodserve.models import native

    k = 512
    stacked = unpack_gguf_experts(expert_bytes(qtype, E, 48, k), qtype, (E, 48, k))
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    groups = torch.tensor([[5, 0, 1], [0, 1, 6], [7, 8, 3]])  # row 7 in no group
    got = native.block_gemv_grouped(x, qtype, stacked.codes, stacked.scales, stacked.mins, stacked.offset, groups,
                                    dtype)
    assert got.shape == (11, 48) and got.dtype == dtype
    for e, first, count in groups.tolist():
        want = native.block_gemv(x[first:first + count], qtype, stacked.codes[e], stacked.scales[e],
                                 None if stacked.mins is None else stacked.mins[e], stacked.offset, dtype)
        assert torch.equal(got[first:first + count], want), (e, first, count)
    assert torch.equal(got[7], torch.zeros(48, dtype=dtype))


@needs_kernel
def test_grouped_kernel_refuses_experts_and_rows_outside():
    from goodserve.models import native

    stacked = unpack_gguf_experts(expert_bytes("Q4_0", 4, 32, 256), "Q4_0", (4, 32, 256))
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    args = ("Q4_0", stacked.codes, stacked.scales, None, stacked.offset)
    with pytest.raises(RuntimeError, match="expert 4 of 4"):
        native.block_gemv_grouped(x, *args, torch.tensor([[4, 0, 1]]), torch.bfloat16)
    with pytest.raises(RuntimeError, match="refused the call"):
        native.block_gemv_grouped(x, *args, torch.tensor([[1, 2, 2]]), torch.bfloat16)
    with pytest.raises(ValueError, match=r"groups must be \[G, 3\] int64"):
        native.block_gemv_grouped(x, *args, torch.tensor([[1, 2]]), torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be \[rows, 256\]"):
        native.block_gemv_grouped(x[:, :128], *args, torch.tensor([[1, 0, 1]]), torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("qtypes", [("Q4_0",) * 3, ("Q4_K", "Q4_K", "Q6_K"), ("Q4_0", "Q8_0", "Q4_1")])
def test_one_call_per_step_equals_one_call_per_expert_bit_for_bit(qtypes):
    """:meth:`BlockExperts.run_sorted` (every expert of at most ``max_rows`` rows in one grouped call, the
    others alone) gives the bits of the per-expert loop over :meth:`BlockExperts.expert_mlp` in bfloat16, at
    batches where some experts get more than ``max_rows`` rows (those run alone, on the kernel here)."""
    from goodserve.models.moe import grouped_by_expert, per_expert

    gate_up, down, _, _ = _layer(qtypes)
    layer = BlockExperts(gate_up, down, torch.bfloat16, max_rows=4, dense_after_rows=10 ** 9)
    for n in (1, 5, 24):
        x, weights, experts = _routing(n)
        x, weights = x.bfloat16(), weights.bfloat16()
        one_call = grouped_by_expert(x, weights, experts, E, layer.run_sorted, torch.bfloat16)
        per_call = grouped_by_expert(x, weights, experts, E, per_expert(layer.expert_mlp), torch.bfloat16)
        assert torch.equal(one_call, per_call), n
        assert n < 24 or torch.bincount(experts.reshape(-1), minlength=E).max() > 4


@needs_kernel
@pytest.mark.parametrize("qtypes", [("Q4_0",) * 3, ("Q4_K", "Q4_K", "Q6_K"), ("Q4_0", "Q8_0", "Q4_1")])
@pytest.mark.parametrize("renormalise,float32_weighting", [(True, False), (False, True)])
def test_the_mlp_in_one_call_equals_route_then_grouped_experts(qtypes, renormalise, float32_weighting):
    """``moe_block`` (router, top-k, experts, weighted sum in one native call) against :func:`route` and the
    grouped experts in float32, for 1 to 8 rows: within 1e-5 of the largest output (float32 sums in another
    order; another expert chosen would be far off); in bfloat16 within bfloat16's rounding."""
    from goodserve.models.moe import grouped_by_expert

    gate_up, down, _, _ = _layer(qtypes)
    router = torch.randn(E, HIDDEN, generator=torch.Generator().manual_seed(7)) * 0.2
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        layer = BlockExperts(gate_up, down, dtype)
        for n in (1, 3, 8):
            x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(n)).to(dtype)
            r = router.to(dtype)
            assert layer.takes_in_one_call(x)
            got = layer.mlp_in_one_call(x, r, 2, renormalise, 1.0, float32_weighting)
            weight_dtype = torch.float32 if float32_weighting else dtype
            weights, experts = route(torch.nn.functional.linear(x, r), 2, renormalise)
            want = grouped_by_expert(x, weights.to(weight_dtype), experts, E, layer.run_sorted, weight_dtype)
            assert got.shape == (n, HIDDEN) and got.dtype == dtype
            assert ((got.double() - want.double()).abs().max() / want.double().abs().max()).item() < tol, (dtype, n)
    assert not layer.takes_in_one_call(torch.randn(9, HIDDEN, dtype=torch.bfloat16))


@needs_kernel
def test_large_steps_run_on_a_dense_copy_of_that_expert_only():
    """The ski-rental rule per expert: in float32 an expert's step of more than ``max_rows`` rows makes its
    copy at once (and then equals the dense computation bit for bit); in bfloat16 only once its steps past
    ``max_rows`` reach ``dense_after_rows`` rows."""
    gate_up, down, gate_up_w, down_w = _layer(("Q8_0",) * 3)
    layer = BlockExperts(gate_up, down, torch.float32, max_rows=4)
    x = torch.randn(5, HIDDEN)
    got = layer.expert_mlp(3, x)
    assert layer.dense_copies() == 1 and layer._dense[3] is not None
    gate, up = torch.nn.functional.linear(x, gate_up_w[3]).split(INTER, dim=-1)
    assert torch.equal(got, torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down_w[3]))
    layer16 = BlockExperts(gate_up, down, torch.bfloat16, max_rows=4, dense_after_rows=12)
    for _ in range(2):
        layer16.expert_mlp(1, x.bfloat16())  # 5 + 5 rows past max_rows: still on the kernel
        layer16.expert_mlp(2, x[:4].bfloat16())  # never past max_rows
    assert layer16.dense_copies() == 0
    layer16.expert_mlp(1, x.bfloat16())  # 15 rows: the copy
    assert layer16._dense[1] is not None and layer16.dense_copies() == 1


@needs_kernel
def test_decode_steps_of_a_128_expert_layer_make_no_dense_copy():
    """Qwen3-30B-A3B's routing (128 experts, top 8) at decode batches 1 to 64, 100 steps each: every expert's
    rows stay on the kernel, no copy of any expert is made."""
    shape = (128, 2 * INTER, HIDDEN)
    gate_up = unpack_gguf_experts(expert_bytes("Q4_0", *shape), "Q4_0", shape)
    down = unpack_gguf_experts(expert_bytes("Q4_0", 128, HIDDEN, INTER, seed=1), "Q4_0", (128, HIDDEN, INTER))
    layer = BlockExperts([gate_up], down, torch.bfloat16)
    from goodserve.models.moe import grouped_by_expert

    for batch in (1, 16, 64):
        for step in range(100):
            x, weights, experts = _routing(batch, 128, 8, seed=1000 * step)
            grouped_by_expert(x.bfloat16(), weights.bfloat16(), experts, 128, layer.run_sorted, torch.bfloat16)
    assert layer.dense_copies() == 0
    assert layer.nbytes == gate_up.nbytes + down.nbytes


def _moe_file(tmp_path, expert_qtype: str = "Q4_0") -> str:
    path = str(tmp_path / f"moe-{expert_qtype}.gguf")
    shape = RandomShape(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, experts=8, top_k=2,
                        moe_intermediate=64)
    write_random_gguf(path, shape, qtype="Q8_0", expert_qtype=expert_qtype)
    return path


@needs_kernel
@pytest.mark.parametrize("expert_qtype, left_out", [("Q4_0", 0), ("Q8_0", 7)])
def test_moe_file_keeps_its_experts_as_blocks_and_greedy_tokens_equal_the_float32_dense_run(tmp_path, caplog,
                                                                                            expert_qtype, left_out):
    """A random qwen3moe GGUF (Q8_0 projections, experts in ``expert_qtype``) under ``--quantization auto`` in
    bfloat16: every MoE layer's experts on the block kernel, reported in the load log, no dense copy after
    short prompts; its greedy tokens equal those of the file dequantized to float32.

    Measured (2026-12-04) on these files: the files dequantized to a dense bfloat16 run differ from float32
    on one (Q8_0) and two (Q4_0) of the nine prompts, none of them the block runs'; the prompt left out with
    Q8_0 experts (7 tokens) is one whose first greedy token has a float32 probability of 0.30 (a near tie
    within bfloat16's error)."""
    from goodserve import LLM

    path = _moe_file(tmp_path, expert_qtype)
    with caplog.at_level(logging.INFO, logger="goodserve.models.gguf_file"):
        llm = LLM(path, dtype="bfloat16", quantization="auto", block_size=4, num_blocks=64, log_stats_interval=0)
    assert f"MoE experts kept as blocks: {expert_qtype} ×4" in caplog.text  # gate/up and down of 2 layers
    layers = llm.engine.core.runner.model.layers
    assert all(isinstance(layer.moe.experts, BlockExperts) and layer.moe.gate_up is None for layer in layers)
    check_greedy_equals_dense_float32(path, left_out=left_out)
    from goodserve import SamplingParams

    llm.generate([[100 + i for i in range(n)] for n in (3, 9, 20)], SamplingParams(temperature=0, max_tokens=12),
                 use_tqdm=False)
    assert [layer.moe.experts.dense_copies() for layer in layers] == [0, 0]


def test_experts_run_dequantized_where_the_block_kernel_does_not_apply(tmp_path, monkeypatch):
    """In float32 asked for (the precision mode), or without the block kernel (its check patched off, as on a
    CPU without AVX-512 VNNI or AVX2), the experts held as blocks are dequantized at load: the same weights,
    bit for bit, as the file loaded dense (``--quantization none``)."""
    from goodserve import LLM

    path = _moe_file(tmp_path)

    def experts(dtype: str, quantization: str) -> list[torch.Tensor]:
        llm = LLM(path, dtype=dtype, quantization=quantization, block_size=4, num_blocks=64, log_stats_interval=0)
        moes = [layer.moe for layer in llm.engine.core.runner.model.layers]
        assert all(m.experts is None for m in moes)
        return [w for m in moes for w in (m.gate_up, m.down)]

    for want, got in zip(experts("float32", "none"), experts("float32", "auto")):
        assert got.dtype == torch.float32 and torch.equal(got, want)
    monkeypatch.setattr(moe_blocks.native, "block_gemv_usable", lambda x: False)
    for want, got in zip(experts("bfloat16", "none"), experts("bfloat16", "auto")):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@needs_kernel
def test_a_moe_file_decodes_in_one_call_as_the_layer_by_layer_path(tmp_path):
    """A qwen3moe GGUF (q/k norms, experts on blocks) gets a one-call decode plan, and its decode steps give the
    hidden states and KV writes of the layer-by-layer path (whose steps of up to 8 rows run each MoE MLP in
    one ``moe_block`` call, the one-call step's own)."""
    from goodserve import LLM
    from test_block_gemv import decode_both_ways

    llm = LLM(_moe_file(tmp_path), dtype="bfloat16", quantization="auto", block_size=4, num_blocks=64,
              log_stats_interval=0)
    model = llm.engine.core.runner.model
    assert model.decode_plan is not None and model.config.qk_norm
    decode_both_ways(model, model.config)
