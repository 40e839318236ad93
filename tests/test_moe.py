"""Mixtral and Qwen3-MoE on the engine, against HF ``transformers`` greedy decoding on tiny random checkpoints.

The MoE MLP (:mod:`goodserve.models.moe`) routes each token to its top-k experts (float32 softmax, then top
k, renormalised for Mixtral and for Qwen3-MoE with ``norm_topk_prob``) and runs the experts grouped by
expert. Tiny models (Mixtral: 4 experts of width 128; Qwen3-MoE: 8 of width 32, q/k norms; top 2, 2 layers,
routers and experts randomized so the expert mix decides the tokens) must give transformers' tokens exactly
(float32): batched, chunked prefill, preempted, on the portable attention backend, and a request alone
equals it beside others. What is not implemented is refused by name before any weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from goodserve import LLM, SamplingParams
from goodserve.config import ModelConfig
from goodserve.models.loader import load_model
from goodserve.models.moe import DOWN, GATE_UP, ROUTER, grouped_experts, route
from goodserve.models.config_support import check_gguf_metadata
from tiny_models import EQUALITY_PROMPTS, hf_greedy, make_tiny_gguf, make_tiny_hf_model, tiny_hf_config

PROMPTS = EQUALITY_PROMPTS
NEW = 12
FAMILIES = ["mixtral", "qwen3_moe"]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def _engine(model_dir, **kwargs):
    return LLM(model_dir, dtype="float32", block_size=4, log_stats_interval=0, **kwargs)


@pytest.mark.parametrize("arch", FAMILIES)
def test_hf_dir_matches_hf(tmp_path, arch):
    """The four prompts batched equal HF's greedy tokens (each run alone): with a budget above every prompt,
    a budget of 7 that chunks every prefill beside the others' decodes, and a pool of 16 blocks of 4 tokens
    that forces preemption and recompute."""
    model_dir = make_tiny_hf_model(tmp_path, arch)
    refs = hf_greedy(model_dir, PROMPTS, NEW)
    assert len({tuple(r) for r in refs}) == len(refs)  # the prompts' continuations differ
    for budget, num_blocks in ((512, 64), (7, 64), (16, 16)):
        llm = _engine(model_dir, num_blocks=num_blocks, max_num_batched_tokens=budget)
        model = llm.engine.config.model
        assert (model.architecture, model.num_experts, model.num_experts_per_tok) == \
            (arch, 4 if arch == "mixtral" else 8, 2)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == refs, (arch, budget)
        kv = llm.engine.core.scheduler.kv_cache_manager
        kv.check_integrity()
        assert kv.usage == 0
        if num_blocks == 16:
            assert llm.engine.core.scheduler.num_preemptions_total > 0


@pytest.mark.parametrize("arch", FAMILIES)
def test_alone_equals_batched_with_others(tmp_path, arch):
    """On the portable attention backend, each request alone gives HF's tokens, and the same tokens when it
    shares every step with the other requests (its experts' rows grouped with theirs)."""
    model_dir = make_tiny_hf_model(tmp_path, arch)
    refs = hf_greedy(model_dir, PROMPTS, NEW)
    llm = _engine(model_dir, num_blocks=64, max_num_batched_tokens=16, attention_backend="torch")
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
    assert alone == refs
    llm.engine.reset_prefix_cache()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == refs


@pytest.mark.parametrize("overrides", [{"norm_topk_prob": False}, {"mlp_only_layers": [1]},
                                       {"decoder_sparse_step": 2}])
def test_qwen3_moe_variants_match_hf(tmp_path, overrides):
    """Qwen3-MoE without renormalised top-k weights, and with a dense MLP on some layers (``mlp_only_layers``;
    ``decoder_sparse_step`` 2 makes layer 0 dense), give HF's tokens, chunked."""
    model_dir = make_tiny_hf_model(tmp_path, "qwen3_moe", overrides=overrides)
    refs = hf_greedy(model_dir, PROMPTS, NEW)
    llm = _engine(model_dir, num_blocks=64, max_num_batched_tokens=7)
    model = llm.engine.config.model
    dense = {"mlp_only_layers": (1,), "decoder_sparse_step": (0,)}.get(next(iter(overrides)), ())
    assert (model.dense_mlp_layers, model.norm_topk_prob) == (dense, "norm_topk_prob" not in overrides)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == refs


def test_loader_stacks_transformers_experts(tmp_path):
    """The loader's stacked experts are transformers' per-expert tensors: gate rows then up rows, and down,
    per expert; Mixtral's w1 / w3 / w2 the same way; routers renamed."""
    for arch, gate_up_name, down_name in (("qwen3_moe", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
                                          ("mixtral", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        model_dir = make_tiny_hf_model(tmp_path, arch)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        ours = load_model(model_dir).weights
        for i in range(2):
            p = f"model.layers.{i}."
            assert torch.equal(ours[p + GATE_UP], hf[p + gate_up_name])
            assert torch.equal(ours[p + DOWN], hf[p + down_name])
            assert torch.equal(ours[p + ROUTER], hf[p + "mlp.gate.weight"])
        assert not any(".experts.0." in n for n in ours)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_qwen3moe_gguf_matches_its_hf_twin(tmp_path, qtype):
    """A qwen3moe GGUF as llama.cpp's converter writes it (``ffn_gate_inp``, experts stacked in 3-D
    ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, ``expert_count`` / ``expert_used_count`` /
    ``expert_feed_forward_length``; projections and experts in F32 or Q8_0 blocks, the experts dequantized)
    gives HF's greedy tokens on the weights it encodes, chunked."""
    path, state = make_tiny_gguf(tmp_path, "qwen3_moe", tie=True, qtype=qtype)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("qwen3_moe", True), dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    hf.save_pretrained(tmp_path / "hf-twin")
    refs = hf_greedy(str(tmp_path / "hf-twin"), PROMPTS, NEW)
    assert len({tuple(r) for r in refs}) == len(refs)
    llm = _engine(path, num_blocks=64, max_num_batched_tokens=7)
    model = llm.engine.config.model
    assert (model.architecture, model.num_experts, model.num_experts_per_tok, model.moe_intermediate_size,
            model.norm_topk_prob, model.qk_norm) == ("qwen3_moe", 8, 2, 32, True, True)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == refs


@pytest.mark.parametrize("key, value", [("expert_count", 0), ("expert_used_count", 0),
                                        ("expert_shared_count", 1), ("expert_weights_scale", 2.5)])
def test_gguf_moe_metadata_refused_by_name(key, value):
    """qwen3moe metadata the engine does not implement (shared experts, scaled weights, zero counts) is
    refused by name; on llama (Mixtral GGUFs) the expert keys stay refused."""
    fields = {"general.architecture": "qwen3moe", "qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2}
    check_gguf_metadata("qwen3moe", fields)
    with pytest.raises(ValueError, match=f"GGUF metadata qwen3moe.{key}={value}"):
        check_gguf_metadata("qwen3moe", {**fields, f"qwen3moe.{key}": value})
    with pytest.raises(ValueError, match="GGUF metadata llama.expert_count=8 is not supported: a mixture of experts"):
        check_gguf_metadata("llama", {"llama.expert_count": 8})


def _naive(x, weights, experts, gate_up, down):
    """Per token, per chosen expert: the reference the grouped computation must equal."""
    inter = down.shape[-1]
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate, up = (gate_up[e].double() @ x[t].double()).split(inter)
            out[t] += float(weights[t, j]) * (down[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 8, 2), (37, 8, 2), (64, 6, 3), (5, 16, 4)])
def test_grouped_experts_equal_naive_per_token(num_tokens, num_experts, top_k):
    """Grouped by expert (one matmul pair per expert with tokens, some experts idle) equals the per-token
    loop within 1e-6; routing weights are a softmax's top k, renormalised to sum to 1."""
    g = torch.Generator().manual_seed(num_tokens)
    hidden, inter = 32, 24
    x = torch.randn(num_tokens, hidden, generator=g)
    gate_up = 0.2 * torch.randn(num_experts, 2 * inter, hidden, generator=g)
    down = 0.2 * torch.randn(num_experts, hidden, inter, generator=g)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    weights, experts = route(logits, top_k, renormalise=True)
    assert torch.allclose(weights.sum(-1), torch.ones(num_tokens))
    assert torch.equal(experts, logits.topk(top_k).indices)
    assert torch.allclose(weights, torch.softmax(logits.topk(top_k).values, -1), atol=1e-6)
    got = grouped_experts(x, weights, experts, gate_up, down, torch.float32)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.allclose(got.double(), _naive(x, weights, experts, gate_up, down), atol=1e-6, rtol=0)


# ------------------------------------------------------------------ config parsing and refusals


REQUIRED = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_defaults_of_left_out_keys_are_transformers(model_type):
    """A config.json with only the required keys parses to transformers' defaults for that class (experts,
    top k, expert width, renormalisation, KV heads, positions, RoPE base), also from the class name alone."""
    ours = ModelConfig.from_hf_config({**REQUIRED, "model_type": model_type})
    theirs = transformers.AutoConfig.for_model(model_type, **REQUIRED)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.num_key_value_heads, ours.max_position_embeddings,
            ours.rms_norm_eps, ours.rope_theta, ours.head_dim) == \
        (theirs.num_local_experts, theirs.num_experts_per_tok, theirs.num_key_value_heads,
         theirs.max_position_embeddings, theirs.rms_norm_eps, theirs.rope_parameters["rope_theta"], 16)
    width = theirs.intermediate_size if model_type == "mixtral" else theirs.moe_intermediate_size
    assert (ours.moe_intermediate_size, ours.norm_topk_prob) == \
        (width, model_type == "mixtral" or theirs.norm_topk_prob)
    assert ours.qk_norm is (model_type == "qwen3_moe") and ours.dense_mlp_layers == ()
    class_name = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[model_type]
    assert ModelConfig.from_hf_config({**REQUIRED, "architectures": [class_name]}) == ours


def test_qwen3_moe_dense_layers_as_transformers_builds_them():
    """``mlp_only_layers`` and ``decoder_sparse_step`` pick the dense layers transformers builds."""
    cfg = {**REQUIRED, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3], "head_dim": 16}
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    theirs = tuple(i for i, layer in enumerate(hf.model.layers) if not hasattr(layer.mlp, "experts"))
    assert ModelConfig.from_hf_config(cfg).dense_mlp_layers == theirs == (0, 2, 3)


def test_qwen3_moe_sliding_window_on_every_layer():
    """Qwen3-MoE applies ``sliding_window`` to every layer when ``use_sliding_window`` (no
    ``max_window_layers``), and not at all without it."""
    cfg = {**REQUIRED, "model_type": "qwen3_moe", "sliding_window": 64}
    assert ModelConfig.from_hf_config({**cfg, "use_sliding_window": True}).sliding_window == 64
    assert ModelConfig.from_hf_config(cfg).sliding_window is None


@pytest.mark.parametrize("model_type, key, value, match", [
    ("mixtral", "num_local_experts", 0, "positive int"),
    ("qwen3_moe", "num_experts", -1, "positive int"),
    ("mixtral", "num_experts_per_tok", 9, "num_experts_per_tok=9 is not supported: expected 1..8"),
    ("qwen3_moe", "decoder_sparse_step", 0, "positive int"),
    ("qwen3_moe", "attention_bias", True, "attention biases on a qwen3_moe model"),
    ("mixtral", "hidden_act", "gelu", "only silu"),
    ("llama", "num_local_experts", 8, "a mixture of experts is not implemented"),
    ("qwen2_moe", "num_experts", 8, "unsupported architecture 'qwen2_moe'"),
])
def test_unsupported_config_refused_by_name_before_weights(tmp_path, model_type, key, value, match):
    """A config.json asking for what the engine does not compute is a ValueError naming the field (or the
    architecture), from a directory holding no weights."""
    (tmp_path / "config.json").write_text(json.dumps({**REQUIRED, "model_type": model_type, key: value}))
    with pytest.raises(ValueError, match=match):
        load_model(str(tmp_path))


def test_batch_invariant_mode_refused(tmp_path):
    """Batch-invariant mode has no invariant expert kernels: refused by name."""
    with pytest.raises(ValueError, match="batch-invariant mode is not implemented for a mixture of experts"):
        _engine(make_tiny_hf_model(tmp_path, "mixtral"), num_blocks=16, batch_invariant=True)


def test_checkpoint_missing_or_extra_expert_refused(tmp_path):
    """A checkpoint with an expert more than the config names is refused by that tensor's name; one lacking an
    expert's tensor names the missing one."""
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_hf_model(tmp_path, "mixtral")
    shard = next(p for p in Path(model_dir).iterdir() if p.suffix == ".safetensors")
    weights = load_file(str(shard))
    extra = "model.layers.0.block_sparse_moe.experts.4.w1.weight"
    save_file({**weights, extra: torch.zeros(128, 64)}, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=extra):
        load_model(model_dir)
    missing = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    save_file({k: v for k, v in weights.items() if k != missing}, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=missing):
        load_model(model_dir)
