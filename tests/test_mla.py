"""DeepSeek-V2 with multi-head latent attention (MLA) on the engine, against HF ``transformers``.

Tiny random DeepSeek-V2 checkpoints (dense layers: ``first_k_dense_replace = num_hidden_layers``, and
DeepSeekMoE variants;
``kv_lora_rank`` 16, ``qk_rope_head_dim`` 8, ``qk_nope_head_dim`` 16, ``v_head_dim`` 16; full-rank and low-rank
queries) must give transformers' greedy tokens exactly in float32: batched, chunked prefill, preempted,
prefix hits, and alone vs beside other requests. The cache holds one latent row of ``kv_lora_rank +
qk_rope_head_dim`` elements per layer and token (DeepSeek-V2 §2.1.2), and the bytes the runner allocates are
the ``mla`` spec's. Decodes attend with ``W_UK`` absorbed into the query; that must equal the expanded
attention. What is not implemented (other routings, RoPE scalings other than yarn, DeepSeek-V3, native kernels, KV transfer) is
refused by name before any weight is read.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import transformers

from goodserve import LLM, SamplingParams
from goodserve.config import ModelConfig
from goodserve.kv_cache.spec import mla_spec
from goodserve.models.attention import AttentionMetadata
from goodserve.models.loader import load_model
from goodserve.models.mla import MLAAttentionBackend
from tiny_models import EQUALITY_PROMPTS, hf_greedy, smollm2_tokenizer

PROMPTS = EQUALITY_PROMPTS
NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
RANK, ROPE, NOPE, V, LAYERS = 16, 8, 16, 16, 2
ATTN_STD = 0.15


def make_tiny_deepseek_v2(tmp_path, q_lora_rank=None, seed=0, overrides=None) -> str:
    """A random tiny dense DeepSeek-V2 saved with ``save_pretrained`` and the SmolLM2 tokenizer; norm weights
    randomized (HF initializes them to ones) and attention weights larger than HF's init (std ``ATTN_STD``,
    not 0.02), so that attention is far from uniform. Returns the directory."""
    cfg = {**dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=RANK, q_lora_rank=q_lora_rank,
               qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V, first_k_dense_replace=LAYERS,
               max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
               tie_word_embeddings=False), **(overrides or {})}
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV2Config(**cfg), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif ".self_attn." in name:  # peaked attention, so the tokens depend on what it attends to
                param.copy_(ATTN_STD * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):  # the MoE router: routing far from uniform
                param.copy_(torch.randn_like(param))
            elif ".experts." in name:  # routed experts strong enough that their mix decides the tokens
                param.copy_(0.2 * torch.randn_like(param))
    tag = hashlib.sha1(repr(sorted((overrides or {}).items())).encode()).hexdigest()[:8]
    out = Path(tmp_path) / f"tiny-deepseek-v2-q{q_lora_rank}-{seed}-{tag}"
    model.eval().save_pretrained(out)
    smollm2_tokenizer().save_pretrained(out)
    return str(out)


def _engine(model_dir, **kwargs):
    return LLM(model_dir, dtype="float32", block_size=4, log_stats_interval=0, **kwargs)


def _tokens(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_hf_dir_matches_hf(tmp_path, q_lora_rank):
    """The four prompts batched equal HF's greedy tokens (each run alone): a budget above every prompt, a budget
    of 7 that chunks every prefill beside the others' decodes, and a pool of 16 blocks of 4 tokens that forces
    preemption and recompute; the pool is whole after each run."""
    model_dir = make_tiny_deepseek_v2(tmp_path, q_lora_rank)
    refs = hf_greedy(model_dir, PROMPTS, NEW)
    assert len({tuple(r) for r in refs}) == len(refs)
    for budget, num_blocks in ((512, 64), (7, 64), (16, 16)):
        llm = _engine(model_dir, num_blocks=num_blocks, max_num_batched_tokens=budget)
        model = llm.engine.config.model
        assert (model.architecture, model.kv_lora_rank, model.q_lora_rank, model.qk_rope_head_dim,
                model.qk_nope_head_dim, model.v_head_dim, model.head_dim) == \
            ("deepseek_v2", RANK, q_lora_rank, ROPE, NOPE, V, NOPE + ROPE)
        assert _tokens(llm, PROMPTS) == refs, (q_lora_rank, budget, num_blocks)
        kv = llm.engine.core.scheduler.kv_cache_manager
        kv.check_integrity()
        assert kv.usage == 0
        if num_blocks == 16:
            assert llm.engine.core.scheduler.num_preemptions_total > 0


def test_prefix_hits_and_batched_with_others(tmp_path):
    """Each request alone gives HF's tokens, and the same beside the others; run again, the prompts' full blocks
    are prefix hits (latent rows read back from the cache by a chunk with cached context) and a prompt that
    extends a cached one reuses its blocks, all still HF's tokens."""
    model_dir = make_tiny_deepseek_v2(tmp_path, 12, seed=1)
    extended = PROMPTS[3] + [300 + 11 * j for j in range(9)]
    refs = hf_greedy(model_dir, PROMPTS + [extended], NEW)
    llm = _engine(model_dir, num_blocks=96, max_num_batched_tokens=16)
    assert [_tokens(llm, [p])[0] for p in PROMPTS] == refs[:4]
    outs = llm.generate(PROMPTS + [extended], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    cached = [o.metrics.num_cached_tokens for o in outs]
    assert all(c > 0 for c in cached[:4]) and cached[4] >= 48, cached
    llm.engine.core.scheduler.kv_cache_manager.check_integrity()


MOE = {"first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
       "moe_intermediate_size": 32, "routed_scaling_factor": 2.0}


@pytest.mark.parametrize("overrides", [MOE, {**MOE, "n_shared_experts": 0, "topk_method": "group_limited_greedy",
                                              "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3}])
def test_deepseek_moe_matches_hf(tmp_path, overrides):
    """DeepSeekMoE after a dense first layer (§2.2: 8 routed experts of width 32, softmax top-k, scaled by
    routed_scaling_factor, plus a shared expert; or group-limited routing, 2 of 4 groups, without a shared
    expert) gives HF's greedy tokens, chunked and preempted."""
    model_dir = make_tiny_deepseek_v2(tmp_path, 12, overrides=overrides)
    refs = hf_greedy(model_dir, PROMPTS, NEW)
    for budget, num_blocks in ((7, 64), (16, 16)):
        llm = _engine(model_dir, num_blocks=num_blocks, max_num_batched_tokens=budget)
        model = llm.engine.config.model
        assert (model.num_experts, model.dense_mlp_layers, model.routed_scaling_factor) == (8, (0,), 2.0)
        assert model.expert_groups == ((4, 2) if "n_group" in overrides else (1, 1))
        assert _tokens(llm, PROMPTS) == refs, (overrides, budget)
        llm.engine.core.scheduler.kv_cache_manager.check_integrity()


def test_yarn_rope_matches_hf(tmp_path):
    """YaRN-scaled RoPE as DeepSeek-V2 ships it (NTK-by-parts frequencies, cos/sin scaled by mscale / mscale_all_dim,
    softmax temperature mscale_all_dim squared), here with an original context of 16 tokens that the prompts
    pass, gives HF's greedy tokens, chunked."""
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "mscale": 0.5,
            "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 1, "rope_theta": 10000.0}
    model_dir = make_tiny_deepseek_v2(tmp_path, 12, overrides={"rope_parameters": yarn})
    refs = hf_greedy(model_dir, PROMPTS, NEW)
    llm = _engine(model_dir, num_blocks=64, max_num_batched_tokens=7)
    model = llm.engine.config.model
    assert model.rope_scaling["rope_type"] == "yarn" and model.rope_scaling["original_max_position_embeddings"] == 16
    assert _tokens(llm, PROMPTS) == refs
    plain = make_tiny_deepseek_v2(tmp_path, 12)  # the same weights without yarn decode differently
    assert hf_greedy(plain, PROMPTS, NEW) != refs


def test_cache_is_one_latent_row_per_layer_and_token(tmp_path):
    """The engine prices a token at the ``mla`` spec (layers x (kv_lora_rank + qk_rope_head_dim) x 4 bytes in
    float32, no factor 2, no heads); the runner allocates per layer one ``[num_blocks, block_size, 1, kv_lora_rank
    + qk_rope_head_dim]`` tensor and no V, num_blocks * block_size * bytes_per_token bytes in all."""
    llm = _engine(make_tiny_deepseek_v2(tmp_path), num_blocks=24)
    model, runner = llm.engine.config.model, llm.engine.core.runner
    spec = model.kv_cache_spec("float32")
    assert spec == mla_spec(LAYERS, RANK, ROPE, "float32")
    assert spec.bytes_per_token() == LAYERS * (RANK + ROPE) * 4
    assert [(tuple(k.shape), v) for k, v in runner.kv_caches] == [((24, 4, 1, RANK + ROPE), None)] * LAYERS
    assert runner.kv_cache_bytes == 24 * 4 * spec.bytes_per_token()
    assert spec.bytes_per_token() < model.num_attention_heads * (NOPE + ROPE + V) * LAYERS * 4  # vs expanded K/V


def test_pool_sized_and_planned_at_the_mla_formula(tmp_path):
    """A KV budget in bytes buys ``budget // (block_size * bytes_per_token)`` blocks of the latent cache, and the
    planner prices the same config.json at the engine's bytes per token."""
    from goodserve.sim.model_size import kv_bytes_per_token
    from goodserve.sim.presets import load_arch

    model_dir = make_tiny_deepseek_v2(tmp_path)
    per_block = 4 * LAYERS * (RANK + ROPE) * 4
    llm = LLM(model_dir, dtype="float32", block_size=4, log_stats_interval=0, kv_cache_memory=37 * per_block + 5)
    assert llm.engine.config.cache.num_blocks == 37
    assert llm.engine.core.runner.kv_cache_bytes == 37 * per_block
    assert kv_bytes_per_token(load_arch(model_dir), "float32") == per_block // 4


def test_ngram_speculation_verifies_over_the_latent_cache(tmp_path):
    """Under n-gram speculation (drafts verified as chunks over the latent cache, rejected slots freed) the
    greedy tokens are still HF's, and some drafts are accepted and some rejected."""
    model_dir = make_tiny_deepseek_v2(tmp_path, 12)
    base = [100 + (7 * i) % 50 for i in range(30)]
    prompts = [base * 2, [5, 6, 7, 8] * 10, base + [3, 4]]
    refs = hf_greedy(model_dir, prompts, 24)
    llm = _engine(model_dir, num_blocks=128, speculative_config='{"method": "ngram", "num_speculative_tokens": 4}',
                  speculative_length="3")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == refs
    stats = llm.engine.make_stats()
    assert stats.num_spec_draft_tokens_total > stats.num_spec_accepted_tokens_total > 0


def test_mla_never_takes_the_native_one_call_decode(tmp_path, monkeypatch):
    """Under ``attention_backend="auto"`` an MLA model runs its own attention and never the native fused decode
    step (which reads per-head K/V)."""
    from goodserve.models import native_decode

    def refuse(*args, **kwargs):
        raise AssertionError("native_decode.decode_layers called for an MLA model")

    monkeypatch.setattr(native_decode, "decode_layers", refuse)
    model_dir = make_tiny_deepseek_v2(tmp_path)
    refs = hf_greedy(model_dir, PROMPTS[:2], NEW)
    llm = _engine(model_dir, num_blocks=64, attention_backend="auto")
    assert type(llm.engine.core.runner.attn) is MLAAttentionBackend
    assert _tokens(llm, PROMPTS[:2]) == refs


def _expanded_reference(q_nope, q_pe, rows, kv_b, scale, lens):
    """Per request, HF's way: K/V expanded from the latent rows, plain softmax attention (float64)."""
    rank, nope = kv_b.shape[-1], q_nope.shape[-1]
    out = []
    for i, n in enumerate(lens):
        latent, k_pe = rows[i, :n, :rank], rows[i, :n, rank:]
        kv = torch.einsum("cr,hdr->hcd", latent, kv_b)  # [heads, ctx, nope + v]
        k = torch.cat([kv[..., :nope], k_pe[None].expand(kv.shape[0], -1, -1)], dim=-1)
        q = torch.cat([q_nope[i], q_pe[i]], dim=-1)[:, None]  # [heads, 1, nope + rope]
        p = torch.softmax((q @ k.transpose(1, 2)) * scale, dim=-1)
        out.append((p @ kv[..., nope:])[:, 0])
    return torch.stack(out)


def test_absorbed_decode_equals_expanded_attention():
    """Decodes with ``W_UK`` absorbed into the query and ``W_UV`` applied after the softmax (three requests of
    different lengths: a lone one cut to its length, and a masked group of two) equal attention over K/V
    expanded from the same latent rows."""
    g = torch.Generator().manual_seed(0)
    heads, block_size, num_blocks = 4, 4, 16
    lens = [3, 9, 14]
    kv_b = torch.randn(heads, NOPE + V, RANK, generator=g, dtype=torch.float64)
    cache = torch.zeros(num_blocks, block_size, 1, RANK + ROPE, dtype=torch.float64)
    tables = [[5], [2, 7, 1], [3, 4, 8, 9]]
    past = torch.randn(3, 16, RANK + ROPE, generator=g, dtype=torch.float64)
    for i, (table, n) in enumerate(zip(tables, lens)):
        for p in range(n - 1):
            cache[table[p // block_size], p % block_size, 0] = past[i, p]
    slots = torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, lens)])
    meta = AttentionMetadata.build(block_size, tables, lens, [], slots, torch.device("cpu"))
    assert sorted(g.mask is None for g in meta.decode_groups) == [False, True]  # a lone request, a masked pair
    q_nope = torch.randn(3, heads, NOPE, generator=g, dtype=torch.float64)
    q_pe = torch.randn(3, heads, ROPE, generator=g, dtype=torch.float64)
    new = torch.randn(3, RANK + ROPE, generator=g, dtype=torch.float64)
    scale = (NOPE + ROPE) ** -0.5
    got = MLAAttentionBackend()(q_nope, q_pe, new[:, :RANK], new[:, RANK:], cache, kv_b, scale, meta)
    for i, n in enumerate(lens):
        past[i, n - 1] = new[i]
    want = _expanded_reference(q_nope, q_pe, past, kv_b, scale, lens)
    assert got.shape == (3, heads, V)
    assert torch.allclose(got, want, atol=1e-10, rtol=0)


# ------------------------------------------------------------------ config parsing and refusals


REQUIRED = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)


def test_defaults_of_left_out_keys_are_transformers():
    """A deepseek_v2 config.json with only the required keys parses to transformers' MLA defaults, also from
    the class name alone; ``head_dim`` is the query/key width nope + rope."""
    ours = ModelConfig.from_hf_config({**REQUIRED, "model_type": "deepseek_v2"})
    theirs = transformers.AutoConfig.for_model("deepseek_v2", **REQUIRED)
    assert (ours.kv_lora_rank, ours.q_lora_rank, ours.qk_nope_head_dim, ours.qk_rope_head_dim, ours.v_head_dim,
            ours.rms_norm_eps, ours.rope_theta, ours.max_position_embeddings, ours.head_dim) == \
        (theirs.kv_lora_rank, theirs.q_lora_rank, theirs.qk_nope_head_dim, theirs.qk_rope_head_dim,
         theirs.v_head_dim, theirs.rms_norm_eps, theirs.rope_parameters["rope_theta"],
         theirs.max_position_embeddings, theirs.qk_nope_head_dim + theirs.qk_rope_head_dim)
    assert ours.is_mla and (ours.num_experts, ours.num_shared_experts, ours.moe_intermediate_size) == \
        (theirs.n_routed_experts, theirs.n_shared_experts, theirs.moe_intermediate_size)
    assert ours.dense_mlp_layers == () and not ours.norm_topk_prob  # first_k_dense_replace 0: every layer MoE
    dense = ModelConfig.from_hf_config({**REQUIRED, "model_type": "deepseek_v2", "first_k_dense_replace": 4})
    assert (dense.num_experts, dense.num_shared_experts) == (0, 0)
    assert ModelConfig.from_hf_config({**REQUIRED, "architectures": ["DeepseekV2ForCausalLM"]}) == ours
    assert ours.kv_cache_spec("bfloat16").bytes_per_token() == 4 * (512 + 64) * 2


DENSE = {**REQUIRED, "model_type": "deepseek_v2", "first_k_dense_replace": 4, "kv_lora_rank": 16, "q_lora_rank": None,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}


@pytest.mark.parametrize("cfg, match", [
    ({**DENSE, "first_k_dense_replace": 1, "norm_topk_prob": True}, "norm_topk_prob=True is not supported"),
    ({**DENSE, "first_k_dense_replace": 1, "topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not supported"),
    ({**DENSE, "first_k_dense_replace": 1, "n_routed_experts": 6, "topk_method": "group_limited_greedy",
      "n_group": 4, "topk_group": 2}, "n_group=4, topk_group=2 is not supported"),
    ({**DENSE, "first_k_dense_replace": 1, "num_experts_per_tok": None}, "num_experts_per_tok=0 is not supported"),
    ({**DENSE, "rope_scaling": {"type": "dynamic", "factor": 4.0}},
     "rope_type 'dynamic' is not implemented for multi-head latent attention"),
    ({**DENSE, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096}},
     "rope_type 'yarn' needs 'factor'"),
    ({**DENSE, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     "rope_type 'linear' is not implemented for multi-head latent attention"),
    ({**DENSE, "attention_bias": True}, "attention biases on a deepseek_v2 model are not implemented"),
    ({**DENSE, "mlp_bias": True}, "MLP biases are not implemented"),
    ({**DENSE, "kv_lora_rank": 0}, "kv_lora_rank=0 is not supported"),
    ({**DENSE, "model_type": "deepseek_v3"}, "unsupported architecture 'deepseek_v3': DeepSeek-V3 shares"),
])
def test_unsupported_config_refused_by_name_before_weights(tmp_path, cfg, match):
    """A config.json asking for what the engine does not compute is a ValueError naming the field (or the
    architecture), from a directory holding no weights."""
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        load_model(str(tmp_path))


@pytest.mark.parametrize("kwargs, match", [
    ({"attention_backend": "native"}, "attention_backend 'native' is not implemented for multi-head latent"),
    ({"batch_invariant": True}, "batch-invariant mode is not implemented for multi-head latent attention"),
])
def test_engine_settings_refused_by_name(tmp_path, kwargs, match):
    """Settings that need per-head K/V kernels are refused by name for an MLA model."""
    with pytest.raises(ValueError, match=match):
        _engine(make_tiny_deepseek_v2(tmp_path), num_blocks=16, **kwargs)


def test_kv_transfer_refused_for_the_latent_cache(tmp_path):
    """The KV connectors move per-layer K and V tensors: an MLA cache is refused by name before a transport
    is imported."""
    from goodserve.kv_transfer.config import KVTransferConfig
    from goodserve.kv_transfer.factory import create_kv_connector

    runner = _engine(make_tiny_deepseek_v2(tmp_path), num_blocks=8).engine.core.runner
    with pytest.raises(ValueError, match="KV transfer of a multi-head latent attention cache"):
        create_kv_connector(KVTransferConfig(role="producer", connector="no.such.module:Nothing"), 4,
                            runner.kv_caches)


def test_checkpoint_tensor_the_model_would_not_read_refused(tmp_path):
    """A tensor outside the MLA layout (here a stray ``k_proj``) is refused by name before weights are read."""
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_deepseek_v2(tmp_path)
    shard = next(p for p in Path(model_dir).iterdir() if p.suffix == ".safetensors")
    extra = "model.layers.0.self_attn.k_proj.weight"
    save_file({**load_file(str(shard)), extra: torch.zeros(4, 64)}, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=extra):
        load_model(model_dir)


def test_expanded_prefill_matches_functional_reference():
    """A prefill chunk with cached context (expanded K/V, causal mask over context + chunk) equals the
    expanded reference row by row."""
    g = torch.Generator().manual_seed(1)
    heads, block_size = 4, 4
    kv_b = torch.randn(heads, NOPE + V, RANK, generator=g, dtype=torch.float64)
    cache = torch.zeros(8, block_size, 1, RANK + ROPE, dtype=torch.float64)
    table, done, new = [6, 1, 3], 5, 4
    rows = torch.randn(done + new, RANK + ROPE, generator=g, dtype=torch.float64)
    for p in range(done):
        cache[table[p // block_size], p % block_size, 0] = rows[p]
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(done, done + new)])
    meta = AttentionMetadata.build(block_size, [], [], [(done, new, table)], slots, torch.device("cpu"))
    q_nope = torch.randn(new, heads, NOPE, generator=g, dtype=torch.float64)
    q_pe = torch.randn(new, heads, ROPE, generator=g, dtype=torch.float64)
    scale = (NOPE + ROPE) ** -0.5
    got = MLAAttentionBackend()(q_nope, q_pe, rows[done:, :RANK], rows[done:, RANK:], cache, kv_b, scale, meta)
    for j in range(new):  # query j sees positions 0 .. done + j
        want = _expanded_reference(q_nope[j:j + 1], q_pe[j:j + 1], rows[None], kv_b, scale, [done + j + 1])
        assert torch.allclose(got[j], want[0], atol=1e-10, rtol=0)
    assert got.shape == (new, heads, V)
