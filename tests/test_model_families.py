"""Qwen3 and Phi-3 on the engine, against HF ``transformers`` greedy decoding on tiny random checkpoints.

Qwen3 adds an RMSNorm over each head of q and k before RoPE (``q_norm`` / ``k_norm``; here with
``head_dim`` 32, not hidden / heads = 16); Phi-3 fuses q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj``, which the loaders split into the Llama names. Both from HF directories and GGUF files
(llama.cpp's ``attn_q_norm`` / ``attn_k_norm``, ``attn_qkv`` / fused ``ffn_up``) must give transformers'
tokens exactly (float32): one batch, chunked prefill, a pool small enough to preempt. What the engine does
not implement of them (LongRoPE, partial rotary, Qwen3's attention biases) is refused by name before any
weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from goodserve import LLM, SamplingParams
from goodserve.config import ModelConfig
from goodserve.models.config_support import check_gguf_metadata, check_gguf_tensors
from goodserve.models.gguf_file import _expected_gguf_names
from goodserve.models.loader import load_model
from goodserve.models.quant import BlockQuantized
from tiny_models import EQUALITY_PROMPTS, hf_greedy, make_tiny_gguf, make_tiny_hf_model, tiny_hf_config

PROMPTS = EQUALITY_PROMPTS
NEW = 12
FAMILIES = ["qwen3", "phi3"]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.mark.parametrize("arch", FAMILIES)
def test_hf_dir_matches_hf(tmp_path, arch):
    """The four prompts batched together equal HF's greedy tokens (each run alone): with a budget above every
    prompt, a budget of 7 that chunks every prefill beside the others' decodes (C02), and a pool of 16 blocks
    of 4 tokens that forces preemption and recompute (C03)."""
    model_dir = make_tiny_hf_model(tmp_path, arch)
    refs = hf_greedy(model_dir, PROMPTS, NEW)
    for budget, num_blocks in ((512, 64), (7, 64), (16, 16)):
        llm = LLM(model_dir, dtype="float32", block_size=4, num_blocks=num_blocks,
                  max_num_batched_tokens=budget, log_stats_interval=0)
        assert llm.engine.config.model.architecture == arch
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == refs, (arch, budget, num_blocks)
        kv = llm.engine.core.scheduler.kv_cache_manager
        kv.check_integrity()
        assert kv.usage == 0
        if num_blocks == 16:
            assert llm.engine.core.scheduler.num_preemptions_total > 0


def test_qwen3_on_the_torch_attention_backend(tmp_path):
    """The portable attention backend (any device) gives the same tokens as HF for Qwen3's normed q/k."""
    model_dir = make_tiny_hf_model(tmp_path, "qwen3")
    refs = hf_greedy(model_dir, PROMPTS, NEW)
    llm = LLM(model_dir, dtype="float32", block_size=4, num_blocks=64, max_num_batched_tokens=16,
              attention_backend="torch", log_stats_interval=0)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == refs


def test_qwen3_batch_invariant_mode(tmp_path):
    """In batch-invariant mode (the q/k norms summed in order too) a request's tokens are the same alone and
    batched with the others."""
    model_dir = make_tiny_hf_model(tmp_path, "qwen3")
    llm = LLM(model_dir, dtype="float32", batch_invariant=True, block_size=4, num_blocks=64,
              max_num_batched_tokens=16, log_stats_interval=0)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
    llm.engine.reset_prefix_cache()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == alone


def _hf_twin(tmp_path, arch, tie, state):
    """A HF directory holding ``state`` (HF names) in ``arch``'s tiny config."""
    hf = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(arch, tie), dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if tie:
        hf.tie_weights()
    out = tmp_path / f"hf-{arch}"
    hf.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("arch, tie, qtype", [("qwen3", True, "F32"), ("phi3", False, "F32"),
                                              ("phi3", False, "Q8_0")])
def test_gguf_matches_its_hf_twin(tmp_path, arch, tie, qtype):
    """A GGUF written as llama.cpp's converter does (qwen3: attn_q_norm / attn_k_norm and key_length 32;
    phi3: attn_qkv, ffn_up holding gate and up, rope.scaling.original_context_length and a zero
    attention.sliding_window; optionally Q8_0 blocks) gives the same greedy tokens as HF on the weights it
    encodes, chunked (budget 7)."""
    path, state = make_tiny_gguf(tmp_path, arch, tie=tie, qtype=qtype)
    refs = hf_greedy(_hf_twin(tmp_path, arch, tie, state), PROMPTS, NEW)
    llm = LLM(path, dtype="float32", block_size=4, num_blocks=64, max_num_batched_tokens=7, log_stats_interval=0)
    model = llm.engine.config.model
    assert (model.architecture, model.head_dim, model.qk_norm, model.sliding_window) == \
        (arch, 32 if arch == "qwen3" else 16, arch == "qwen3", None)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == refs


def test_phi3_fused_blocks_split_as_the_dense_weights(tmp_path):
    """A Q8_0 phi3 GGUF kept as blocks: attn_qkv and ffn_up are split along their rows into q/k/v and gate/up
    blocks whose values are the dense load's (and the HF tensors' rows, q then k then v, gate then up)."""
    path, state = make_tiny_gguf(tmp_path, "phi3", tie=False, qtype="Q8_0")
    dense, blocks = load_model(path).weights, load_model(path, keep_quantized=True).weights
    assert set(dense) == set(blocks)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in dense)
    for i in range(2):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv, gate_up = state[a + "qkv_proj.weight"], state[m + "gate_up_proj.weight"]
        for name, rows in ((a + "q_proj.weight", qkv[:64]), (a + "k_proj.weight", qkv[64:96]),
                           (a + "v_proj.weight", qkv[96:]), (m + "gate_proj.weight", gate_up[:128]),
                           (m + "up_proj.weight", gate_up[128:])):
            assert isinstance(blocks[name], BlockQuantized) and blocks[name].qtype == "Q8_0"
            assert torch.equal(blocks[name].dequantize(), dense[name]), name
            assert torch.equal(dense[name], rows), name


def test_hf_loader_weights_are_transformers_split(tmp_path):
    """The HF loader's Phi-3 weights are transformers' fused tensors cut by rows; Qwen3's q/k norms pass."""
    phi3 = make_tiny_hf_model(tmp_path, "phi3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(phi3, dtype=torch.float32).state_dict()
    ours = load_model(phi3).weights
    qkv = hf["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(ours["model.layers.1.self_attn.k_proj.weight"], qkv[64:96])
    assert torch.equal(ours["model.layers.1.mlp.up_proj.weight"], hf["model.layers.1.mlp.gate_up_proj.weight"][128:])
    qwen3 = load_model(make_tiny_hf_model(tmp_path, "qwen3")).weights
    assert qwen3["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert qwen3["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)


# ------------------------------------------------------------------ config parsing as transformers reads it


REQUIRED = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_defaults_of_left_out_keys_are_transformers(model_type):
    """A config.json with only the required keys parses to transformers' defaults for that class (Qwen3:
    head_dim 128, 32 KV heads, 32768 positions; Phi-3: rms_norm_eps 1e-5, 4096 positions), and a config
    naming only the class maps to the model type."""
    ours = ModelConfig.from_hf_config({**REQUIRED, "model_type": model_type})
    theirs = transformers.AutoConfig.for_model(model_type, **REQUIRED)
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert (ours.head_dim, ours.num_key_value_heads, ours.max_position_embeddings, ours.rms_norm_eps,
            ours.rope_theta, ours.tie_word_embeddings) == \
        (head_dim, theirs.num_key_value_heads, theirs.max_position_embeddings, theirs.rms_norm_eps,
         theirs.rope_parameters["rope_theta"], theirs.tie_word_embeddings)
    assert ours.qk_norm is (model_type == "qwen3") and not ours.attention_bias
    class_name = {"qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}[model_type]
    assert ModelConfig.from_hf_config({**REQUIRED, "architectures": [class_name]}) == ours


# ------------------------------------------------------------------ refused before any weight is read


LONGROPE = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}


@pytest.mark.parametrize("model_type, key, value, match", [
    ("phi3", "rope_scaling", LONGROPE, "rope_type 'longrope' is not implemented"),
    ("phi3", "rope_scaling", {**LONGROPE, "type": "su"}, "rope_type 'su' is not implemented"),
    ("phi3", "partial_rotary_factor", 0.75, "only 1.0"),
    ("phi3", "sliding_window", -1, "positive int"),
    ("phi3", "hidden_act", "gelu_new", "only silu"),
    ("qwen3", "attention_bias", True, "attention biases on a qwen3 model"),
    ("qwen3", "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
     "rope_type 'yarn' is not implemented"),
    ("qwen3", "layer_types", ["full_attention", "chunked_attention"], "chunked_attention"),
])
def test_unsupported_config_refused_by_name_before_weights(tmp_path, model_type, key, value, match):
    """A config.json asking for what the engine does not compute (Phi-3's 128k LongRoPE, partial rotary, a
    Qwen3 with attention biases, YaRN) is a ValueError naming the field, from a directory holding no weights."""
    (tmp_path / "config.json").write_text(json.dumps({**REQUIRED, "model_type": model_type, key: value}))
    with pytest.raises(ValueError, match=f"config.json {key}=.*{match}"):
        load_model(str(tmp_path))


def test_phi3_checkpoint_with_unfused_or_misshaped_projections_refused(tmp_path):
    """Phi-3 holds q/k/v fused: a separate q_proj (which transformers' Phi-3 would not read) is refused by
    name, and a qkv_proj of the wrong rows is a ValueError naming it, not a wrong split."""
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_hf_model(tmp_path, "phi3")
    shard = next(p for p in Path(model_dir).iterdir() if p.suffix == ".safetensors")
    weights = load_file(str(shard))
    weights["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    save_file(weights, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight"):
        load_model(model_dir)
    del weights["model.layers.0.self_attn.q_proj.weight"]
    weights["model.layers.1.self_attn.qkv_proj.weight"] = weights["model.layers.1.self_attn.qkv_proj.weight"][:96]
    save_file(weights, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.qkv_proj.weight' has shape \(96, 64\)"):
        load_model(model_dir)


def _config(arch):
    return ModelConfig(architecture=arch, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                       qk_norm=arch == "qwen3")


@pytest.mark.parametrize("arch, name, reason", [
    ("phi3", "rope_factors_long.weight", "LongRoPE"),
    ("phi3", "rope_factors_short.weight", "LongRoPE"),
    ("phi3", "blk.0.attn_q.weight", "no use for it"),
    ("phi3", "blk.0.ffn_gate.weight", "no use for it"),
    ("qwen3", "blk.0.attn_q.bias", "bias"),
    ("qwen2", "blk.0.attn_q_norm.weight", "normalisation"),
])
def test_gguf_tensor_the_family_lacks_refused(arch, name, reason):
    """Per architecture, the GGUF tensors the engine reads; others are refused by name (LongRoPE's factors,
    unfused projections in a phi3 file, q/k norms outside qwen3)."""
    expected = _expected_gguf_names(_config(arch))
    if arch == "phi3":
        assert {"blk.1.attn_qkv.weight", "blk.1.ffn_up.weight"} <= expected
    if arch == "qwen3":
        assert {"blk.1.attn_q_norm.weight", "blk.1.attn_k_norm.weight", "blk.1.attn_q.weight"} <= expected
    check_gguf_tensors(sorted(expected), expected)
    with pytest.raises(ValueError, match=f"GGUF tensor '{name}' is not supported: .*{reason}"):
        check_gguf_tensors(["token_embd.weight", name], expected)


def test_gguf_phi3_longrope_metadata_refused():
    """A phi3 GGUF converted from a 128k (LongRoPE) checkpoint carries rope.scaling.attn_factor != 1: refused
    by name; the original context length and a zero window that every phi3 GGUF carries pass."""
    fields = {"general.architecture": "phi3", "phi3.rope.scaling.original_context_length": 4096,
              "phi3.attention.sliding_window": 0}
    check_gguf_metadata("phi3", fields)
    with pytest.raises(ValueError, match="GGUF metadata phi3.rope.scaling.attn_factor=1.19"):
        check_gguf_metadata("phi3", {**fields, "phi3.rope.scaling.attn_factor": 1.19})
