"""llama.cpp ``deepseek2`` GGUFs (DeepSeek-V2) on the engine, against HF ``transformers`` on the original model.

Tiny random DeepSeek-V2 checkpoints (``tests/test_mla.py``'s: full-rank and low-rank queries, dense layers, a
DeepSeekMoE layer with routed and shared experts) are written as F32 GGUFs the way llama.cpp's converter
(``convert_hf_to_gguf.py``, class ``DeepseekV2Model``) writes them: its tensor names (``attn_kv_a_mqa``,
``attn_q_a`` / ``attn_q_b``, ``ffn_*_exps`` stacked, ``ffn_*_shexp``), ``kv_b_proj`` split per head into
``attn_k_b`` (transposed) and ``attn_v_b`` as the current converter does or kept whole as ``attn_kv_b`` as
older ones did, no rotary row permutation, and its metadata (``head_count_kv`` 1, ``key_length`` /
``value_length`` of the latent beside ``key_length_mla`` / ``value_length_mla``, or the per-head widths
alone). ``load_model`` must give the HF directory's ModelConfig, and the engine's greedy tokens must equal
transformers' on the HF model, token for token in float32. What the engine does not compute (renormalised or
sigmoid gating, DeepSeek-V3's expert bias, YaRN without its log multiplier) is refused by name before any
tensor is read.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import numpy as np
import pytest
import torch

from goodserve import LLM
from goodserve.models.loader import load_model
from test_mla import GREEDY, MOE, PROMPTS, NEW, make_tiny_deepseek_v2
from tiny_models import add_smollm2_tokenizer, hf_greedy

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj":
          "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
          "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          **{f"mlp.shared_experts.{w}_proj": f"ffn_{w}_shexp" for w in ("gate", "up", "down")}}


def write_deepseek2_gguf(model_dir: str, path: str, split_kv_b: bool = True, extra: dict | None = None,
                         extra_tensors: tuple[str, ...] = ()) -> str:
    """Write the HF checkpoint in ``model_dir`` as an F32 ``deepseek2`` GGUF, as llama.cpp's converter does.

    Args:
        split_kv_b: The current converter's ``attn_k_b`` ([heads, rank, nope], W_UK transposed) and ``attn_v_b``
            ([heads, v, rank]) with the latent ``key_length`` / ``value_length`` and the ``_mla`` keys; else the
            older layout: ``attn_kv_b`` and the per-head widths in ``key_length`` / ``value_length``.
        extra: Metadata keys (under ``deepseek2.``) set on top, ``None`` values dropping a key.
        extra_tensors: Names of extra (zero) tensors to add.
    """
    import gguf
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    state = {}
    for shard in glob.glob(os.path.join(model_dir, "*.safetensors")):
        state.update(load_file(shard))
    heads, rank, rope = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v, layers = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["num_hidden_layers"]
    meta = {"context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
            "feed_forward_length": cfg["intermediate_size"], "block_count": layers,
            "attention.head_count": heads, "attention.head_count_kv": 1 if split_kv_b else heads,
            "rope.freq_base": cfg["rope_parameters"]["rope_theta"],
            "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"], "vocab_size": cfg["vocab_size"],
            "leading_dense_block_count": cfg["first_k_dense_replace"], "attention.kv_lora_rank": rank,
            "expert_feed_forward_length": cfg["moe_intermediate_size"], "expert_count": cfg.get("n_routed_experts"),
            "expert_used_count": cfg.get("num_experts_per_tok"), "expert_shared_count": cfg.get("n_shared_experts"),
            "expert_weights_scale": cfg.get("routed_scaling_factor"), "rope.dimension_count": rope}
    if cfg.get("q_lora_rank"):
        meta["attention.q_lora_rank"] = cfg["q_lora_rank"]
    if split_kv_b:
        meta.update({"attention.key_length": rank + rope, "attention.value_length": rank,
                     "attention.key_length_mla": nope + rope, "attention.value_length_mla": v})
    else:
        meta.update({"attention.key_length": nope + rope, "attention.value_length": v})
    if cfg.get("topk_method") == "group_limited_greedy":
        meta.update({"expert_group_count": cfg["n_group"], "expert_group_used_count": cfg["topk_group"]})
    meta.update(extra or {})

    writer = gguf.GGUFWriter(path, "deepseek2")
    for key, value in meta.items():
        if value is None:
            continue
        full = f"deepseek2.{key}"
        if isinstance(value, str):
            writer.add_string(full, value)
        elif isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, value)
    add_smollm2_tokenizer(writer)

    def add(name: str, array: torch.Tensor) -> None:
        writer.add_tensor(name, np.ascontiguousarray(array.numpy()))

    experts: dict[tuple[int, str], list] = {}
    for name, tensor in sorted(state.items()):
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", tensor)
        elif name == "model.norm.weight":
            add("output_norm.weight", tensor)
        elif name == "lm_head.weight":
            add("output.weight", tensor)
        elif ".mlp.experts." in name:  # stacked per layer and projection, experts in order
            _, _, layer, _, _, e, proj, _ = name.split(".")
            experts.setdefault((int(layer), proj), []).append((int(e), tensor))
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            if module == "self_attn.kv_b_proj" and split_kv_b:
                k_b, v_b = tensor.view(heads, nope + v, rank).split([nope, v], dim=1)
                add(f"blk.{layer}.attn_k_b.weight", k_b.transpose(1, 2))
                add(f"blk.{layer}.attn_v_b.weight", v_b)
                continue
            add(f"blk.{layer}.{_LAYER[module]}.weight", tensor)
    for (layer, proj), parts in sorted(experts.items()):
        add(f"blk.{layer}.ffn_{proj.split('_')[0]}_exps.weight", torch.stack([t for _, t in sorted(parts)]))
    for name in extra_tensors:
        add(name, torch.zeros(cfg.get("n_routed_experts") or 1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _engine(path, **kwargs):
    return LLM(path, dtype="float32", block_size=4, log_stats_interval=0, **kwargs)


@pytest.mark.parametrize("q_lora_rank, overrides, split_kv_b", [
    (None, None, True),
    (12, None, False),
    (12, MOE, True),
    (12, {**MOE, "n_shared_experts": 0, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
          "num_experts_per_tok": 3}, False),
])
def test_gguf_matches_hf(tmp_path, q_lora_rank, overrides, split_kv_b):
    """The GGUF loads to the HF directory's ModelConfig, and the engine on it (chunked prefill, preemption)
    gives transformers' greedy tokens on the HF model: full-rank and low-rank queries, kv_b split or whole,
    dense layers and DeepSeekMoE (routed + shared experts; group-limited routing without shared experts)."""
    model_dir = make_tiny_deepseek_v2(tmp_path, q_lora_rank, overrides=overrides)
    path = write_deepseek2_gguf(model_dir, str(tmp_path / "tiny-deepseek2.gguf"), split_kv_b)
    ours, theirs = load_model(path).config, load_model(model_dir).config
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)  # GGUF floats are float32
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs
    refs = hf_greedy(model_dir, PROMPTS, NEW)
    for budget, num_blocks in ((7, 64), (16, 16)):
        llm = _engine(path, num_blocks=num_blocks, max_num_batched_tokens=budget)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == refs, (budget, num_blocks)
        llm.engine.core.scheduler.kv_cache_manager.check_integrity()


def test_gguf_yarn_matches_hf(tmp_path):
    """YaRN as the converter writes it (``rope.scaling.type`` yarn, factor, original context, and
    ``yarn_log_multiplier`` = 0.1 * mscale_all_dim) gives the HF config's rope_scaling and HF's greedy tokens
    for a model with mscale == mscale_all_dim (DeepSeek-V2's own configs), past the original context."""
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "mscale": 1.0,
            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
    model_dir = make_tiny_deepseek_v2(tmp_path, 12, overrides={"rope_parameters": yarn})
    path = write_deepseek2_gguf(model_dir, str(tmp_path / "yarn.gguf"), extra={
        "rope.scaling.type": "yarn", "rope.scaling.factor": 40.0, "rope.scaling.original_context_length": 16,
        "rope.scaling.yarn_log_multiplier": 0.1})
    ours, theirs = load_model(path).config.rope_scaling, load_model(model_dir).config.rope_scaling
    for key, value in theirs.items():
        assert ours[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    refs = hf_greedy(model_dir, PROMPTS, NEW)
    llm = _engine(path, num_blocks=64, max_num_batched_tokens=7)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == refs


@pytest.mark.parametrize("extra, tensors, match", [
    ({"expert_weights_norm": True}, (), "deepseek2.expert_weights_norm=True is not supported"),
    ({"expert_gating_func": 2}, (), "deepseek2.expert_gating_func=2 is not supported: only softmax"),
    ({}, ("blk.1.exp_probs_b.bias",), "'blk.1.exp_probs_b.bias' is not supported"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 16}, (),
     "deepseek2.rope.scaling.yarn_log_multiplier is missing"),
    ({"rope.scaling.type": "longrope"}, (), "deepseek2.rope.scaling.type='longrope' is not supported"),
    ({"attention.kv_lora_rank": 0}, (), "deepseek2.attention.kv_lora_rank=0 is not supported"),
    ({"attention.q_lora_rank": 0}, (), "deepseek2.attention.q_lora_rank=0 is not supported"),
    ({"nextn_predict_layers": 1}, (), "deepseek2.nextn_predict_layers=1 is not supported"),
])
def test_unsupported_gguf_refused_by_name_before_tensors(tmp_path, monkeypatch, extra, tensors, match):
    """What the engine does not compute is a ValueError naming the key or tensor, raised from the metadata and
    tensor list alone (reading any tensor's data fails the test)."""
    from goodserve.models import gguf_file

    model_dir = make_tiny_deepseek_v2(tmp_path, 12, overrides=MOE)
    path = write_deepseek2_gguf(model_dir, str(tmp_path / "refused.gguf"), extra=extra, extra_tensors=tensors)

    def no_reads(*args, **kwargs):
        raise AssertionError("a tensor was read before the refusal")

    monkeypatch.setattr(gguf_file, "_gguf_tensor", no_reads)
    with pytest.raises(ValueError, match=match):
        load_model(path)


def test_header_only_file_refused_naming_the_missing_key(tmp_path):
    """A ``deepseek2`` file without its MLA keys is refused naming the first one missing (no tensor is read)."""
    import gguf

    path = str(tmp_path / "header-only.gguf")
    writer = gguf.GGUFWriter(path, "deepseek2")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 16), ("attention.head_count", 2)):
        writer.add_uint32(f"deepseek2.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF metadata deepseek2.attention.kv_lora_rank is missing"):
        load_model(path)
