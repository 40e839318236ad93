"""Issue 34: no silent wrong output from a config the engine does not implement.

Every config field the loaders meet is implemented (checked against transformers here), capped (a GGUF's sliding
window: ``max_model_len`` capped to it, where full attention is exact), refused with a ValueError naming the
field before any weight is read, or ignored for a stated reason (``goodserve.models.config_support``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from goodserve.model_config import ModelConfig, hf_sliding_window
from goodserve.models import config_support
from goodserve.models.config_support import (GGUF_RULES, HF_RULES, check_gguf_metadata, check_gguf_tensors,
                                             resolve_max_model_len)
from goodserve.models.field_rule import HANDLINGS
from goodserve.models.gguf_file import _expected_gguf_names
from goodserve.models.loader import load_model
from tiny_models import make_tiny_hf_model

W = 8  # the window of the transformers-only checks
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5)


# ------------------------------------------------------------------ what transformers applies


def _first_position_unlike_full_attention(raw: dict) -> int | None:
    """Build ``raw`` (a config.json dict) and its full-attention twin in transformers with the same weights;
    the first position whose logits differ, or ``None``."""
    import transformers

    full = {**raw, "sliding_window": None, "use_sliding_window": False}
    models = []
    for cfg in (raw, full):
        config = transformers.AutoConfig.for_model(**cfg)
        torch.manual_seed(0)
        models.append(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    ids = torch.arange(100, 100 + 3 * W)[None]
    with torch.no_grad():
        a, b = (m(ids).logits[0] for m in models)
    differs = [i for i in range(ids.shape[1]) if not torch.equal(a[i], b[i])]
    return differs[0] if differs else None


@pytest.mark.parametrize("raw, window", [
    (dict(model_type="mistral", sliding_window=W), W),
    (dict(model_type="mistral", sliding_window=None), None),
    (dict(model_type="llama", sliding_window=W), None),
    (dict(model_type="qwen2", sliding_window=W, use_sliding_window=False, max_window_layers=0), None),
    (dict(model_type="qwen2", sliding_window=W, use_sliding_window=True, max_window_layers=0), W),
    (dict(model_type="qwen2", sliding_window=W, use_sliding_window=True, max_window_layers=1), W),
    (dict(model_type="qwen2", sliding_window=W, use_sliding_window=True, max_window_layers=2), None),
    (dict(model_type="qwen2", sliding_window=W, use_sliding_window=True,
          layer_types=["full_attention", "full_attention"]), None),
    (dict(model_type="phi3", sliding_window=W, pad_token_id=0), W),
    (dict(model_type="phi3", sliding_window=None, pad_token_id=0), None),
    (dict(model_type="qwen3", sliding_window=W, use_sliding_window=False, max_window_layers=0), None),
    (dict(model_type="qwen3", sliding_window=W, use_sliding_window=True, max_window_layers=1), W),
    (dict(model_type="qwen3", sliding_window=W, use_sliding_window=True, max_window_layers=2), None),
])
def test_sliding_window_as_transformers_applies_it(raw, window):
    """Issue 34: ``hf_sliding_window`` reads the window transformers applies, and its boundary is exact: a
    window of W equals full attention at positions 0..W-1 (a token sees W positions, itself included) and
    differs from position W on, so a sequence of W tokens is exact and W + 1 is not."""
    raw = {**BASE, **raw}
    assert hf_sliding_window(raw) == window
    assert ModelConfig.from_hf_config(raw).sliding_window == window
    assert _first_position_unlike_full_attention(raw) == window


# ------------------------------------------------------------------ max_model_len within the window


def _model(window, positions=1024):
    return ModelConfig(architecture="mistral", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=positions, sliding_window=window)


def test_resolve_max_model_len(caplog):
    """Issue 34: a window shorter than the context caps max_model_len (WARNING) unless the user asked for
    more, which is refused naming sliding_window; no window, or one past the positions, changes nothing."""
    with caplog.at_level(logging.WARNING, logger="goodserve.models.config_support"):
        assert resolve_max_model_len(None, _model(24)) == 24
    assert any("sliding_window=24" in m and "capping max_model_len to 24" in m for m in caplog.messages)
    assert resolve_max_model_len(16, _model(24)) == 16
    assert resolve_max_model_len(24, _model(24)) == 24
    with pytest.raises(ValueError, match=r"max_model_len=25 .*sliding_window=24"):
        resolve_max_model_len(25, _model(24))
    assert resolve_max_model_len(None, _model(None)) == 1024
    assert resolve_max_model_len(4096, _model(None)) == 1024
    assert resolve_max_model_len(None, _model(2048)) == 1024
    assert resolve_max_model_len(2000, _model(2048)) == 1024


def _hf_greedy(model_dir, prompts, news):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for prompt, new in zip(prompts, news):
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0)
            refs.append(out[0, len(prompt):].tolist())
    return hf, refs


def _engine_greedy(model_dir, prompts, news, **kwargs):
    from goodserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", block_size=4, num_blocks=64, log_stats_interval=0, **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in news]
    return llm, [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _prompts(lengths):
    return [[100 + (7 * i + 3 * j) % 4000 for j in range(n)] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("arch", ["mistral", "phi3"])
def test_windowed_model_not_capped_and_equals_hf(tmp_path, caplog, arch):
    """Issue 31 (was capped, issue 34): a Mistral or Phi-3 (every layer windowed) whose sliding_window (24) is
    shorter than its 1024 positions is served past the window (windowed attention is implemented; nothing
    about the window logged), and greedy output past the window equals transformers' windowed model token for
    token (fp32); an explicit --max-model-len past the window is accepted."""
    window = 24
    model_dir = make_tiny_hf_model(tmp_path, arch, overrides={"sliding_window": window})
    prompts = _prompts((5, 12, 20, 23))
    news = [window + 6 - len(p) for p in prompts]
    hf, refs = _hf_greedy(model_dir, prompts, news)
    assert hf.config.sliding_window == window
    with caplog.at_level(logging.WARNING, logger="goodserve.models.config_support"):
        llm, outs = _engine_greedy(model_dir, prompts, news)
    assert llm.engine.max_model_len > window
    assert not any("sliding_window" in m for m in caplog.messages)
    assert outs == refs
    llm, _ = _engine_greedy(model_dir, prompts[:1], [1], max_model_len=window + 1)
    assert llm.engine.max_model_len == window + 1


def test_qwen2_use_sliding_window_false_keeps_full_context(tmp_path):
    """Issue 34: a Qwen2 config.json with sliding_window set but use_sliding_window false (as Qwen2.5 ships)
    is served with its full context; transformers ignores the window then, and greedy output past the window
    equals it."""
    model_dir = make_tiny_hf_model(tmp_path, "qwen2")
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("layer_types")
    cfg.update(sliding_window=W, use_sliding_window=False, max_window_layers=0)
    path.write_text(json.dumps(cfg))
    prompts = _prompts((5, 17, 33))
    hf, refs = _hf_greedy(model_dir, prompts, [12] * 3)
    assert hf.config.sliding_window is None
    llm, outs = _engine_greedy(model_dir, prompts, [12] * 3)
    assert llm.engine.config.model.sliding_window is None
    assert resolve_max_model_len(None, llm.engine.config.model) == 1024
    assert llm.engine.max_model_len == 256  # the pool's 64 blocks of 4 tokens hold less than 1024
    assert outs == refs


# ------------------------------------------------------------------ implemented fields equal transformers


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {"head_dim": 32}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0}}),
    ("llama", {"hidden_act": "swish"}),
])
def test_implemented_fields_equal_hf(tmp_path, arch, overrides):
    """Issue 34: head_dim != hidden_size / heads, linear RoPE scaling and swish are implemented: greedy
    output equals transformers' token for token (fp32)."""
    model_dir = make_tiny_hf_model(tmp_path, arch, overrides=overrides)
    prompts = _prompts((5, 33))
    _, refs = _hf_greedy(model_dir, prompts, [12, 12])
    _, outs = _engine_greedy(model_dir, prompts, [12, 12])
    assert outs == refs


# ------------------------------------------------------------------ refused fields


#: A value each refused (field, model_type) asks for; every rule with a check must have one.
HF_REFUSED = {
    ("rope_scaling", ""): {"rope_type": "yarn", "factor": 4.0},
    ("rope_parameters", ""): {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    ("partial_rotary_factor", ""): 0.5,
    ("hidden_act", ""): "gelu",
    ("attention_bias", "llama"): True,
    ("attention_bias", "qwen3"): True,
    ("mlp_bias", "llama"): True,
    ("sliding_window", "mistral"): -1,
    ("sliding_window", "qwen2"): 0.5,
    ("layer_types", "qwen2"): ["linear_attention", "full_attention"],
    ("quantization_config", ""): {"quant_method": "gptq", "bits": 4},
    ("rope_interleaved", ""): True,
    ("attn_logit_softcapping", ""): 50.0,
    ("final_logit_softcapping", ""): 30.0,
    ("qk_norm", ""): True,
    ("use_qk_norm", ""): True,
    ("num_local_experts", ""): 8,
    ("num_experts", ""): 8,
    ("attention_bias", "qwen3_moe"): True,
    ("sliding_window", "qwen3_moe"): -1,
    ("num_local_experts", "mixtral"): 0,
    ("num_experts", "mixtral"): 0,
    ("num_experts_per_tok", "mixtral"): 0,
    ("decoder_sparse_step", "qwen3_moe"): 0,
    **{(key, "deepseek_v2"): 0 for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                           "v_head_dim", "n_routed_experts")},
    ("rope_scaling", "deepseek_v2"): {"rope_type": "dynamic", "factor": 2.0},
    ("rope_parameters", "deepseek_v2"): {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0},
    ("attention_bias", "deepseek_v2"): True,
    ("mlp_bias", "deepseek_v2"): True,
    ("topk_method", "deepseek_v2"): "noaux_tc",
    ("norm_topk_prob", "deepseek_v2"): True,
    ("hidden_activation", "gemma3_text"): "gelu",
    ("sliding_window", "gemma3_text"): 0,
    ("layer_types", "gemma3_text"): ["linear_attention", "full_attention"],
    ("rope_parameters", "gemma3_text"): {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "linear", "factor": 2.0}},
    ("rope_scaling", "gemma3_text"): {"rope_type": "yarn", "factor": 4.0},
    ("attention_bias", "gemma3_text"): True,
    ("use_bidirectional_attention", "gemma3_text"): True,
}


def _checked(rules):
    return {(r.field, r.model_types[0] if r.model_types else "") for r in rules if r.problem is not None}


def test_every_checked_rule_has_a_refused_example():
    assert _checked(HF_RULES) == set(HF_REFUSED)
    assert _checked(GGUF_RULES) == set(GGUF_REFUSED)
    assert {r.handling for r in HF_RULES + GGUF_RULES} <= set(HANDLINGS)


@pytest.mark.parametrize("field, model_type", sorted(HF_REFUSED))
def test_hf_refused_field_names_it_before_weights(tmp_path, field, model_type):
    """Issue 34: each refused config.json field gives a ValueError naming it, from a directory without
    weights (so the refusal comes before any weight is read)."""
    model_type = model_type or "llama"
    cfg = {**BASE, "model_type": model_type, field: HF_REFUSED.get((field, model_type),
                                                                  HF_REFUSED.get((field, "")))}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"config.json {field}="):
        load_model(str(tmp_path))


def test_nested_rope_and_llama3_without_its_keys_refused():
    for value in ({"full_attention": {"rope_type": "default"}}, {"rope_type": "llama3", "factor": 8.0},
                  {"rope_type": "default", "partial_rotary_factor": 0.5}):
        with pytest.raises(ValueError, match="config.json rope_scaling="):
            config_support.check_hf_config({**BASE, "rope_scaling": value}, "llama")


def test_unknown_hf_key_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="goodserve.models.config_support"):
        config_support.check_hf_config({**BASE, "model_type": "llama", "my_new_knob": 3}, "llama")
    assert any("my_new_knob" in m for m in caplog.messages)
    assert not any("vocab_size" in m for m in caplog.messages)


GGUF_REFUSED = {
    ("context_length", ""): [1024, 1024],
    ("embedding_length", ""): [64],
    ("feed_forward_length", ""): [128, 256],
    ("block_count", ""): [2],
    ("attention.head_count", ""): [4, 4],
    ("attention.head_count_kv", ""): [2, 1],
    ("attention.key_length", ""): [16],
    ("attention.value_length", ""): [16],
    ("rope.scaling.type", ""): "yarn",
    ("rope.scaling.attn_factor", ""): 0.8,
    ("attention.sliding_window", ""): -4,
    ("expert_count", ""): 8,
    ("expert_used_count", ""): 2,
    ("attn_logit_softcapping", ""): 50.0,
    ("final_logit_softcapping", ""): 30.0,
    ("logit_scale", ""): 0.5,
    ("embedding_scale", ""): 12.0,
    ("residual_scale", ""): 0.2,
    ("attention.scale", ""): 0.1,
    ("attention.clamp_kqv", ""): 8.0,
    ("attention.layer_norm_epsilon", ""): 1e-5,
    ("expert_count", "qwen3moe"): 0,
    ("expert_used_count", "qwen3moe"): 0,
    ("attention.sliding_window", "gemma3"): -4,
    ("attention.sliding_window_pattern", "gemma3"): 4,
    ("rope.scaling.type", "gemma3"): "yarn",
    ("attention.kv_lora_rank", "deepseek2"): 0,
    ("attention.q_lora_rank", "deepseek2"): 0,
    ("rope.scaling.type", "deepseek2"): "linear",
    ("expert_weights_norm", "deepseek2"): True,
    ("expert_gating_func", "deepseek2"): 2,
}


@pytest.mark.parametrize("key", sorted({k for k, _ in GGUF_REFUSED}) + ["attention.made_up"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_gguf_refused_metadata_names_it(arch, key):
    """Issue 34: each refused GGUF key (and any key under the architecture that no rule covers) gives a
    ValueError naming it."""
    value = GGUF_REFUSED.get((key, ""), 1)
    fields = {"general.architecture": arch, f"{arch}.block_count": 2, f"{arch}.{key}": value}
    with pytest.raises(ValueError, match=f"GGUF metadata {arch}.{key}="):
        check_gguf_metadata(arch, fields)


@pytest.mark.parametrize("key", sorted(k for k, arch in GGUF_REFUSED if arch == "deepseek2"))
def test_gguf_deepseek2_refused_metadata_names_it(key):
    """The deepseek2 rules' refused examples (MLA widths, RoPE scaling, gating) are refused by name too."""
    fields = {"general.architecture": "deepseek2", f"deepseek2.{key}": GGUF_REFUSED[(key, "deepseek2")]}
    with pytest.raises(ValueError, match=f"GGUF metadata deepseek2.{key}="):
        check_gguf_metadata("deepseek2", fields)


def test_gguf_accepted_metadata_and_split():
    check_gguf_metadata("llama", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0,
                                  "llama.expert_count": 0, "general.name": "x", "tokenizer.ggml.model": "gpt2"})
    with pytest.raises(ValueError, match="split.count=2"):
        check_gguf_metadata("llama", {"split.count": 2})


@pytest.mark.parametrize("name, reason", [
    ("rope_freqs.weight", "RoPE frequency factors"),
    ("blk.0.ffn_gate_exps.weight", "mixture of experts"),
    ("blk.0.ffn_gate_inp.weight", "mixture of experts"),
    ("blk.1.attn_q_norm.weight", "normalisation"),
    ("blk.0.attn_output.bias", "bias"),
    ("blk.0.attn_q.bias", "bias"),  # a llama GGUF: no q/k/v biases
    ("blk.0.attn_rot_embd.weight", "no use for it"),
])
def test_gguf_refused_tensor_names_it(name, reason):
    expected = _expected_gguf_names(_model(None))
    assert "blk.1.ffn_norm.weight" in expected and "output.weight" in expected
    check_gguf_tensors(sorted(expected), expected)
    with pytest.raises(ValueError, match=f"GGUF tensor '{name}' is not supported: .*{reason}"):
        check_gguf_tensors(["token_embd.weight", name], expected)


def test_gguf_file_refused_before_tensors(tmp_path):
    """Issue 34: the GGUF loader refuses a Llama 3.1-style rope_freqs tensor (which it used to skip with a
    warning) and a MoE key, from the metadata and tensor list alone."""
    import gguf
    import numpy as np

    for extra_key, tensor, match in ((None, "rope_freqs.weight", "rope_freqs"), ("expert_count", None,
                                                                                  "llama.expert_count=8")):
        path = str(tmp_path / f"{match[:5]}.gguf")
        writer = gguf.GGUFWriter(path, "llama")
        for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                           ("feed_forward_length", 16), ("attention.head_count", 2)):
            writer.add_uint32(f"llama.{key}", value)
        if extra_key:
            writer.add_uint32(f"llama.{extra_key}", 8)
        writer.add_tensor(tensor or "token_embd.weight", np.ones((4,), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ValueError, match=match):
            load_model(path)


def test_hf_checkpoint_tensor_the_model_would_not_read_refused(tmp_path):
    """Issue 34: a safetensors tensor the model would not read (here an MLP bias the config does not
    declare) is refused by name instead of dropped."""
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_hf_model(tmp_path, "llama")
    shard = next(p for p in Path(model_dir).iterdir() if p.suffix == ".safetensors")
    weights = load_file(str(shard))
    weights["model.layers.1.mlp.down_proj.bias"] = torch.zeros(64)
    save_file(weights, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.bias"):
        load_model(model_dir)


def test_docs_name_every_rule():
    """The rule table in docs/architecture.md names every field the tables hold."""
    docs = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    section = docs[docs.index("## Config fields"):]
    missing = sorted({r.field for r in HF_RULES + GGUF_RULES if f"`{r.field}`" not in section})
    assert not missing



def test_llama3_pretraining_length_as_transformers_reads_it():
    """The llama3 RoPE's original_max_position_embeddings is the rope dict's, else max_position_embeddings;
    a top-level key of that name is not read (as transformers' ``standardize_rope_params``)."""
    import transformers

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    for top, inner in (({"original_max_position_embeddings": 64}, {"original_max_position_embeddings": 128}),
                       ({"original_max_position_embeddings": 64}, {}), ({}, {"original_max_position_embeddings": 96})):
        cfg = {**BASE, "model_type": "llama", **top, "rope_scaling": {**rope, **inner}}
        ours = ModelConfig.from_hf_config(cfg).rope_scaling["original_max_position_embeddings"]
        theirs = transformers.AutoConfig.for_model(**cfg).rope_parameters["original_max_position_embeddings"]
        assert ours == theirs == inner.get("original_max_position_embeddings", 1024)
