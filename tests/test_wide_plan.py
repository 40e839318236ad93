"""Steps past the block kernel's rows in one native call on the native GEMM's packed dense copies
(``models/decode_plans.py``, issue 32): the copy each block-quantized layer makes, which plan a step of
``rows`` rows takes, and the one-call step equal to the layer-by-layer path on the same copies."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from goodserve.models import native, native_decode
from goodserve.models.attention import NativeAttentionBackend
from goodserve.models.decode_plans import dense_copy
from goodserve.models.invariant import InvariantLinear, kernel_mode
from goodserve.models.llama import LlamaForCausalLM
from goodserve.models.quant import make_dense_copies
from test_block_gemv import _config, _model, _weights
from test_one_call_short_rows import BS, _step

pytestmark = pytest.mark.skipif(not native.block_gemv_usable(torch.empty(0)),
                                reason="the block kernel needs AVX-512 VNNI or AVX2 and a C++ compiler")
AMX = kernel_mode() == "amx"
TINY_Q4_K_M = str(Path(__file__).parent / "data" / "tiny-llama-q4_k_m.gguf")


def test_the_dense_copy_is_the_native_gemms_where_it_runs_on_amx():
    torch.manual_seed(0)
    w, x = torch.randn(48, 64).bfloat16(), torch.randn(7, 64).bfloat16()
    copy = dense_copy(w, None)
    assert isinstance(copy, InvariantLinear) == AMX
    reference = F.linear(x.double(), w.double())
    assert torch.allclose(copy(x).double(), reference, rtol=1e-2, atol=1e-2)
    assert not isinstance(dense_copy(torch.randn(40, 64).bfloat16(), None), InvariantLinear)  # 40 % 16 != 0
    assert not isinstance(dense_copy(torch.randn(48, 64), None), InvariantLinear)  # float32: oneDNN's / torch's


def test_steps_past_four_rows_take_the_wide_plan_once_the_copies_are_made():
    c = _config()
    model, attn = _model(c, _weights(c)), NativeAttentionBackend()
    tables = [[4 * i + j for j in range(4)] for i in range(16)]
    meta16 = _step([(t, 5) for t in tables], [])[1]
    assert model.one_call_plan(16) is model.decode_plan and model.decode_plan.max_rows == 8
    assert not model.can_decode_in_one_call(16, meta16, attn)  # no copies yet: layer by layer
    assert make_dense_copies(model) == 3 * 4 + 1  # every projection and the head
    wide = model.one_call_plan(16)
    assert model.one_call_plan(4) is model.decode_plan
    if not AMX:  # the copies are oneDNN's: the one-call step keeps the block kernel's rows
        assert wide is model.decode_plan and not model.can_decode_in_one_call(16, meta16, attn)
        return
    assert wide is not model.decode_plan and model.one_call_plan(5) is wide
    assert wide.max_rows == native_decode.INVARIANT_DECODE_MAX_ROWS
    assert model.can_decode_in_one_call(16, meta16, attn)
    assert wide.layer_ints[0, :3].tolist() == [16, 0, c.num_attention_heads * c.head_dim
                                               + 2 * c.num_key_value_heads * c.head_dim]  # the GEMM's kind 0


def test_batch_invariant_mode_has_no_wide_plan():
    """Its one plan is already the native GEMM's, for every step size."""
    c = _config()
    with torch.device("meta"):
        model = LlamaForCausalLM(c)
    model.load_weights(_weights(c), torch.bfloat16, "auto", batch_invariant=True)
    assert make_dense_copies(model) == 0  # no QuantLinear: every layer is an InvariantLinear
    assert model.one_call_plan(16) is model.decode_plan


@pytest.mark.skipif(not AMX, reason="the wide plan runs where the native GEMM runs on AMX")
def test_the_wide_one_call_step_equals_the_layer_by_layer_path_on_the_copies():
    """Twelve requests prefill, then three steps: 12 decodes, 10 decodes with a 3-token chunk, 6 decodes:
    each step's hidden states and KV writes from the one-call step equal the layer-by-layer path's."""
    c = _config()
    model, attn = _model(c, _weights(c)), NativeAttentionBackend()
    make_dense_copies(model)
    shape = (200, BS, c.num_key_value_heads, c.head_dim)
    caches = {way: [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
                    for _ in range(c.num_hidden_layers)] for way in ("one call", "layers")}
    tables = [[12 * i + j for j in range(12)] for i in range(12)]
    lens = [3 + (5 * i) % 17 for i in range(12)]
    ids = iter(range(20, 900))
    with torch.inference_mode():
        for way, kv in caches.items():
            for table, n in zip(tables, lens):
                positions, meta = _step([], [(table, 0, n)])
                model(torch.tensor([(7 * j + n) % 500 for j in range(n)]), positions, kv, meta, attn)
        for decodes, chunks in ((list(range(12)), []), (list(range(10)), [(11, 3)]), ([1, 3, 5, 7, 9, 11], [])):
            decodes = sorted(decodes, key=lambda i: lens[i])
            positions, meta = _step([(tables[i], lens[i]) for i in decodes],
                                    [(tables[i], lens[i], n) for i, n in chunks])
            tokens = torch.tensor([next(ids) for _ in positions])
            assert model.one_call_plan(len(tokens)) is not model.decode_plan
            assert model.can_decode_in_one_call(len(tokens), meta, attn)
            fused = model.decode_in_one_call(tokens, positions, caches["one call"], meta, attn)
            assert torch.equal(fused, model(tokens, positions, caches["layers"], meta, attn))
            for i in decodes:
                lens[i] += 1
            for i, n in chunks:
                lens[i] += n
    for (k1, v1), (k2, v2) in zip(caches["one call"], caches["layers"]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.skipif(not AMX, reason="the wide plan runs where the native GEMM runs on AMX")
def test_greedy_tokens_of_a_q4_k_m_file_in_wide_steps_equal_the_layer_by_layer_run(monkeypatch):
    """``tests/data/tiny-llama-q4_k_m.gguf`` (q/k/v parts in two block types), twelve requests batched with the
    copies made: the decode steps of 5-12 rows run in one call on the wide plan, those of up to 4 on the block
    plan, and the greedy tokens equal the run with every step layer by layer."""
    from goodserve import LLM, SamplingParams

    calls = []  # (rows, the plan's max_rows) of each one-call step
    decode_layers = native_decode.decode_layers

    def counted(plan, embeddings, *args):
        calls.append((embeddings.shape[0], plan.max_rows))
        return decode_layers(plan, embeddings, *args)

    monkeypatch.setattr(native_decode, "decode_layers", counted)
    prompts = [[(11 * i + 3 * j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=12 + 2 * i, ignore_eos=True) for i in range(12)]
    runs = {}
    for fused in (True, False):
        llm = LLM(TINY_Q4_K_M, dtype="bfloat16", quantization="auto", block_size=4, num_blocks=256,
                  log_stats_interval=0, fused_decode_step=fused)
        make_dense_copies(llm.engine.core.runner.model)
        runs[fused] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        model = llm.engine.core.runner.model
        assert model.one_call_plan(8) is not model.decode_plan
    assert runs[True] == runs[False]
    wide = native_decode.INVARIANT_DECODE_MAX_ROWS
    assert (12, wide) in calls and {plan for rows, plan in calls if rows > 4} == {wide}
    assert {plan for rows, plan in calls if rows <= 4} == {8}  # the block plan's, as requests finish
