"""Batch-invariant mode (issue 34): a request's tokens and logprobs depend on its prompt and seed alone.

Kernel by kernel (each row's result bit-identical whatever shares its call), then the whole engine: 32
prompts, greedy and seeded-sampled, run alone, in one batch, shuffled, with prefix hits and after
preemption, on the default GGUF model and on dense checkpoints (float32 and bfloat16, native kernels and
the torch path).
"""

import random

import pytest
import torch

from goodserve import LLM, SamplingParams
from goodserve.models import invariant, native_build
from goodserve.models.attention import AttentionMetadata
from goodserve.models.invariant import InvariantLinear, rms_norm_torch
from goodserve.models.invariant_attention import SPLIT_TOKENS, InvariantAttentionBackend
from tiny_models import make_tiny_hf_model

NATIVE = invariant.kernel_mode() != "none"
needs_native = pytest.mark.skipif(not NATIVE, reason="the native batch-invariant kernel does not build here")


def _rows_invariant(fn, x: torch.Tensor) -> None:
    """``fn`` on every slice of ``x`` gives the rows ``fn(x)`` gives (bit for bit)."""
    full = fn(x)
    for start, rows in ((0, 1), (5, 1), (3, 2), (7, 5), (0, 16), (1, 17), (20, 33), (40, len(x) - 40)):
        assert torch.equal(fn(x[start:start + rows]), full[start:start + rows]), (start, rows)


@needs_native
@pytest.mark.parametrize("mode", ["amx", "avx512_bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_gemm_rows_do_not_depend_on_the_batch(mode, dtype):
    if mode == "amx" and invariant.kernel_mode() != "amx":
        pytest.skip("no AMX on this machine")
    torch.manual_seed(0)
    try:
        invariant.kernel_mode(force=mode)
        for n, k in ((96, 64), (576, 1536), (48, 576)):
            w, bias = torch.randn(n, k), torch.randn(n)
            layer = InvariantLinear(w, bias, dtype)
            assert layer.packed is not None
            x = torch.randn(90, k).to(dtype)
            _rows_invariant(layer.forward, x)
            ref = x.double() @ w.to(dtype).double().T + bias.double()
            err = (layer.forward(x).double() - ref).abs().max() / ref.abs().max()
            assert err < (4e-3 if dtype == torch.bfloat16 else 1e-5), err  # bf16 output rounding: 2^-9
    finally:
        invariant.kernel_mode(force="amx")  # the cap lifts to what the machine has


def test_torch_path_rows_do_not_depend_on_the_batch():
    """A shape the native kernel does not take (N not a multiple of 16) runs the GEMM library on fixed tiles."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        layer = InvariantLinear(torch.randn(40, 72), torch.randn(40), dtype)
        assert layer.packed is None
        _rows_invariant(layer.forward, torch.randn(90, 72).to(dtype))


def test_torch_rms_norm_sums_in_order():
    torch.manual_seed(0)
    w = torch.rand(4096) + 0.5
    _rows_invariant(lambda x: rms_norm_torch(x, w, 1e-5), torch.randn(90, 4096))
    x = torch.randn(8, 4096)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert torch.allclose(rms_norm_torch(x, w, 1e-5).double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kvh, hd, heads", [(2, 16, 4), (2, 64, 6)])  # bfloat16 at head_dim 64: AMX rows
def test_attention_of_a_token_is_the_same_in_a_chunk_as_a_decode(use_native, dtype, kvh, hd, heads):
    """Tokens 0..L-1 of a request prefilled as one chunk, as two chunks (a prefix hit), or one by one as
    decodes beside another request's decode get the same attention output bit for bit; it matches a
    float64 reference."""
    torch.manual_seed(0)
    bs, n = 4, 2 * SPLIT_TOKENS + 37
    backend = InvariantAttentionBackend(use_native)
    q = torch.randn(n, heads, hd).to(dtype)
    assert backend.uses_amx(q, kvh) == (use_native and backend.amx and dtype == torch.bfloat16 and hd == 64)
    nb = -(-n // bs)
    table = list(range(nb))
    other = list(range(nb, 2 * nb))
    k, v = torch.randn(n, kvh, hd).to(dtype), torch.randn(n, kvh, hd).to(dtype)
    cpu = torch.device("cpu")

    def fresh():
        return torch.zeros(2 * nb, bs, kvh, hd, dtype=dtype), torch.zeros(2 * nb, bs, kvh, hd, dtype=dtype)

    def slots(tab, start, end):
        return torch.tensor([tab[p // bs] * bs + p % bs for p in range(start, end)])

    kc, vc = fresh()
    whole = backend(q, k, v, kc, vc, AttentionMetadata.build(bs, [], [], [(0, n, table)], slots(table, 0, n), cpu,
                                                             decode_groups=False, per_row=True))
    kc, vc = fresh()
    cut = 300
    first = backend(q[:cut], k[:cut], v[:cut], kc, vc, AttentionMetadata.build(
        bs, [], [], [(0, cut, table)], slots(table, 0, cut), cpu, decode_groups=False, per_row=True))
    rest = backend(q[cut:], k[cut:], v[cut:], kc, vc, AttentionMetadata.build(
        bs, [], [], [(cut, n - cut, table)], slots(table, cut, n), cpu, decode_groups=False, per_row=True))
    assert torch.equal(torch.cat([first, rest]), whole)
    kc, vc = fresh()
    qo, ko, vo = torch.randn(1, heads, hd).to(dtype), torch.randn(1, kvh, hd).to(dtype), torch.randn(1, kvh, hd).to(dtype)
    for p in range(n - 20, n):  # the last 20 tokens as decodes, a second request's decode beside each
        if p == n - 20:
            backend(q[:p], k[:p], v[:p], kc, vc, AttentionMetadata.build(
                bs, [], [], [(0, p, table)], slots(table, 0, p), cpu, decode_groups=False, per_row=True))
        meta = AttentionMetadata.build(bs, [other[:1], table[:p // bs + 1]], [1, p + 1], [],
                                       torch.cat([slots(other, 0, 1), slots(table, p, p + 1)]), cpu,
                                       decode_groups=False, per_row=True)
        out = backend(torch.cat([qo, q[p:p + 1]]), torch.cat([ko, k[p:p + 1]]), torch.cat([vo, v[p:p + 1]]), kc, vc,
                      meta)
        assert torch.equal(out[1], whole[p]), p
    group = heads // kvh
    kr, vr = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kr) / hd ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vr)
    assert (whole.double() - ref).abs().max() < (2e-2 if dtype == torch.bfloat16 else 1e-5)


def _prompts(count: int = 32, shared: int = 40) -> list[list[int]]:
    """``count`` prompts of 3-40 tokens; the second half shares a ``shared``-token prefix (prefix hits)."""
    rng = random.Random(0)
    head = [rng.randrange(300, 40000) for _ in range(shared)]
    out = []
    for i in range(count):
        tail = [rng.randrange(300, 40000) for _ in range(3 + (i * 7) % 38)]
        out.append(head + tail if i >= count // 2 else tail)
    return out


def _params(i: int, n: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
    return SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=n, ignore_eos=True, logprobs=2)


def _result(out):
    c = out.outputs[0]
    return list(c.token_ids), c.logprobs, c.top_logprobs


def _check_engine(llm: LLM, preempting: LLM, count: int = 32, n: int = 8) -> None:
    prompts = _prompts(count)
    params = [_params(i, n) for i in range(count)]
    alone = [_result(llm.generate([p], [sp], use_tqdm=False)[0]) for p, sp in zip(prompts, params)]
    llm.engine.reset_prefix_cache()
    batch = [_result(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert batch == alone
    order = list(range(count))
    random.Random(1).shuffle(order)
    shuffled = llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
    assert {i: _result(o) for i, o in zip(order, shuffled)} == dict(enumerate(alone))  # prefix hits now
    assert llm.engine.make_stats().prefix_cache_hits > 0
    again = [_result(o) for o in preempting.generate(prompts, params, use_tqdm=False)]
    assert preempting.engine.core.scheduler.num_preemptions_total > 0
    assert again == alone
    for engine in (llm.engine, preempting.engine):
        engine.core.scheduler.kv_cache_manager.check_integrity()


@pytest.mark.slow
@needs_native
def test_default_model_is_batch_invariant(default_model_path):
    """The default GGUF (its Q4_1 / Q8_0 blocks dequantized into the invariant kernel's bfloat16 tiles)."""
    kw = dict(batch_invariant=True, log_stats_interval=0, max_num_batched_tokens=64)
    llm = LLM(default_model_path, **kw)
    assert isinstance(llm.engine.core.runner.model.lm_head, InvariantLinear)
    _check_engine(llm, LLM(default_model_path, num_blocks=12, **kw))


@pytest.mark.parametrize("dtype, kernels", [("float32", True), ("bfloat16", True), ("float32", False)])
def test_dense_checkpoint_is_batch_invariant(tmp_path, monkeypatch, dtype, kernels):
    """A tiny HF checkpoint in float32 and bfloat16 on the native kernels, and on the torch path (no native
    kernels: GEMM-library tiles, ordered sums, the torch attention)."""
    if kernels and not NATIVE:
        pytest.skip("the native batch-invariant kernel does not build here")
    if not kernels:
        monkeypatch.setattr(native_build, "_loaded", False)
    model_dir = make_tiny_hf_model(tmp_path, "llama")
    kw = dict(dtype=dtype, batch_invariant=True, log_stats_interval=0, block_size=4, max_num_batched_tokens=32)
    llm = LLM(model_dir, num_blocks=256, **kw)
    assert (llm.engine.core.runner.model.lm_head.packed is not None) == kernels
    _check_engine(llm, LLM(model_dir, num_blocks=24, **kw), count=32 if kernels else 12)


@needs_native
def test_one_call_decode_step_equals_the_layer_path():
    """The one-call decode step (``native_decode.decode_layers``) and the layer-by-layer path give the same hidden
    states and KV writes bit for bit in batch-invariant mode (same GEMM, attention and SiLU kernels), for every
    kind of step: three prompts at once, decodes, decodes beside short chunks (rows verifying drafts, issue 33),
    and beside a chunk of several attention runs."""
    from test_block_gemv import _config, _weights

    from goodserve.models import native_decode
    from goodserve.models.llama import LlamaForCausalLM
    from goodserve.models.short_rows import decode_rows

    c = _config()
    with torch.device("meta"):
        model = LlamaForCausalLM(c)
    model.load_weights(_weights(c), torch.bfloat16, "auto", batch_invariant=True)
    assert model.decode_plan is not None
    attn, bs, cpu = InvariantAttentionBackend(True), 4, torch.device("cpu")
    shape = (64, bs, c.num_key_value_heads, c.head_dim)
    caches = {f: [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
                  for _ in range(c.num_hidden_layers)] for f in (True, False)}
    tables, lens = [[12 * i + j for j in range(12)] for i in range(3)], [0, 0, 0]
    steps = ({0: 5, 1: 2, 2: 9}, {}, {}, {}, {1: 3}, {0: 4, 2: 2}, {1: 2, 0: 1}, {2: 20})  # request: new tokens
    with torch.inference_mode():
        for step, chunks in enumerate(steps):
            order = sorted((i for i in range(3) if i not in chunks), key=lambda i: lens[i])
            rows = [(i, lens[i]) for i in order] + [(i, lens[i] + j) for i, n in chunks.items() for j in range(n)]
            slots = torch.tensor([tables[i][p // bs] * bs + p % bs for i, p in rows])
            meta = AttentionMetadata.build(bs, [tables[i][:lens[i] // bs + 1] for i in order],
                                           [lens[i] + 1 for i in order], [(lens[i], n, tables[i])
                                                                          for i, n in chunks.items()],
                                           slots, cpu, decode_groups=False, per_row=True)
            ids, positions = torch.tensor([10 + i + p for i, p in rows]), torch.tensor([p for _, p in rows])
            assert model.can_decode_in_one_call(len(rows), meta, attn)
            fused = model.decode_in_one_call(ids, positions, caches[True], meta, attn)
            assert torch.equal(fused, model(ids, positions, caches[False], meta, attn)), step
            for i, _ in rows:
                lens[i] += 1
        with pytest.raises(ValueError, match="run_starts"):  # runs that do not end at the last row
            native_decode.decode_layers(model.decode_plan, model.embed_tokens(ids), positions, caches[True],
                                        meta.slot_mapping, *decode_rows(meta), model.rope_cos_sin(torch.bfloat16),
                                        SPLIT_TOKENS, True, torch.tensor([0, 5], dtype=torch.int32))
    for (k1, v1), (k2, v2) in zip(caches[True], caches[False]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@needs_native
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_packing_a_block_weight_gives_its_dense_copy(qtype):
    """The one-pass native packing of a GGUF block weight holds the values of its dense bfloat16 copy (the
    layer outputs are then the same bits as a layer made from that copy)."""
    from test_block_gemv import _blocks

    w = _blocks(qtype, 48, 128)
    dense = w.dequantize().to(torch.bfloat16)
    assert torch.equal(invariant.pack(w, torch.bfloat16), invariant.pack(dense, torch.bfloat16))
    ref = dense.view(3, 16, 4, 16, 2).permute(0, 2, 3, 1, 4)
    assert torch.equal(invariant.pack(dense, torch.bfloat16), ref)
    x = torch.randn(7, 128).to(torch.bfloat16)
    assert torch.equal(InvariantLinear(w, None, torch.bfloat16).forward(x),
                       InvariantLinear(dense, None, torch.bfloat16).forward(x))


@pytest.mark.slow
@needs_native
def test_a_positions_logprobs_are_the_same_in_any_request(default_model_path):
    """Issue 34: the first output position's logprobs of one prompt, asked by a greedy request and by a
    seeded sampled one (the second hits the prefix cache the first filled), are the same numbers."""
    llm = LLM(default_model_path, batch_invariant=True, log_stats_interval=0)
    prompt = _prompts(1, shared=40)[0] + [1234, 5678]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    sampled = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=1, logprobs=5),
                           use_tqdm=False)[0]
    assert sampled.metrics.num_cached_tokens > 0
    assert greedy.outputs[0].top_logprobs == sampled.outputs[0].top_logprobs
