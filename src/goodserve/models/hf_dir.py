"""Read a Hugging Face model directory: ``config.json``, safetensors shards and the tokenizer.

``config.json`` is parsed by :meth:`goodserve.config.ModelConfig.from_hf_config` (shared with the
simulator's presets); this module adds what the engine can run: Llama-family decoders with a SwiGLU MLP
and RMSNorm, every config field checked against :mod:`goodserve.models.config_support` and every tensor
name against what the model reads, before any weight is read. Qwen3's ``q_norm`` / ``k_norm`` pass as they
are; Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` are split into the Llama names; Mixtral's and Qwen3-MoE's
per-expert tensors are stacked (:func:`goodserve.models.moe.stack_experts`). DeepSeek-V2 (multi-head
latent attention, DeepSeekMoE) keeps its own names (:func:`goodserve.models.deepseek_v2.expected_weight_names`),
its routed experts stacked as the others'.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Optional

import torch

from goodserve.model_config import ModelConfig, hf_model_type
from goodserve.models.config_support import check_hf_config
from goodserve.models.checkpoint import (LoadedModel, fused_projection_sizes, load_hf_tokenizer,
                                        split_fused_projections, tokenizer_chat_template, with_tokenizer_eos)
from goodserve.models.deepseek_v2 import expected_weight_names as mla_weight_names
from goodserve.models.moe import hf_layer_names, stack_experts


#: HF ``model_type`` values we can run (Llama-family decoders with SwiGLU MLPs or mixtures of them, and RMSNorm).
SUPPORTED_HF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "deepseek_v2",
                              "gemma3_text")
#: Known model types refused with a reason of their own.
REFUSED_HF_ARCHITECTURES = {
    "deepseek_v3": "DeepSeek-V3 shares DeepSeek-V2's multi-head latent attention (implemented), but its mixture of "
                   "experts (sigmoid scores, noaux_tc group routing, e_score_correction_bias) is not implemented",
}


def hf_config_to_model_config(cfg: dict[str, Any], generation_cfg: Optional[dict[str, Any]] = None) -> ModelConfig:
    """Build the :class:`ModelConfig` of a model the engine can run from a parsed HF ``config.json``.

    Parsing is :meth:`ModelConfig.from_hf_config`'s; this adds what the engine supports
    (:func:`~goodserve.models.config_support.check_hf_config`).

    Args:
        cfg: The ``config.json`` contents.
        generation_cfg: The ``generation_config.json`` contents, if any; its EOS ids are merged in.

    Returns:
        The model config.

    Raises:
        ValueError: On an unsupported architecture, a field the engine does not implement (named with its
            value), or a missing required key.
    """
    model_type = hf_model_type(cfg)
    if model_type in REFUSED_HF_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {model_type!r}: {REFUSED_HF_ARCHITECTURES[model_type]}")
    if model_type == "gemma3":
        raise ValueError("unsupported architecture 'gemma3' (Gemma3ForConditionalGeneration, text and vision): "
                         "only the text-only Gemma3ForCausalLM ('gemma3_text') is supported")
    if model_type not in SUPPORTED_HF_ARCHITECTURES:
        named = model_type or cfg.get("architectures")
        raise ValueError(
            f"unsupported architecture {named!r}; supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
        )
    check_hf_config(cfg, model_type)
    if model_type == "deepseek_v2":
        check_deepseek_v2_groups(cfg)
    config = ModelConfig.from_hf_config(cfg, generation_cfg)
    if config.num_experts and not 0 < config.num_experts_per_tok <= config.num_experts:
        raise ValueError(f"config.json num_experts_per_tok={config.num_experts_per_tok} is not supported: expected "
                         f"1..{config.num_experts} (the experts per MoE layer)")
    return config


def check_deepseek_v2_groups(cfg: dict[str, Any]) -> None:
    """Refuse DeepSeek-V2 group-limited routing whose groups do not cut the experts evenly.

    Raises:
        ValueError: naming ``n_group`` / ``topk_group`` when ``topk_method`` is ``group_limited_greedy`` and
            ``n_routed_experts`` is not a multiple of ``n_group`` or ``topk_group`` is not in ``1..n_group``.
    """
    if cfg.get("topk_method") != "group_limited_greedy":
        return
    experts, groups, top = cfg.get("n_routed_experts", 64), cfg.get("n_group"), cfg.get("topk_group")
    if not (isinstance(groups, int) and isinstance(top, int) and groups > 0 and experts % groups == 0
            and 0 < top <= groups):
        raise ValueError(f"config.json n_group={groups!r}, topk_group={top!r} is not supported: group_limited_greedy "
                         f"needs n_group dividing n_routed_experts={experts} and 1 <= topk_group <= n_group")


def expected_weight_names(config: ModelConfig) -> set[str]:
    """HF names of every tensor the checkpoint holds for ``config`` (``lm_head.weight`` included, used when
    untied): Phi-3's fused projections in place of the parts they hold, Qwen3's q/k norms, a mixture-of-experts
    layer's router and per-expert projections in place of the dense MLP's."""
    if config.is_mla:
        return mla_weight_names(config)
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    if config.architecture == "gemma3_text":
        from goodserve.models.gemma3 import GEMMA3_LAYER_WEIGHTS

        return names | {f"model.layers.{i}.{part}.weight" for i in range(config.num_hidden_layers)
                        for part in GEMMA3_LAYER_WEIGHTS}
    parts = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    parts = [f"{part}.weight" for part in parts]
    for fused, (split, _) in fused_projection_sizes(config).items():
        parts = [part for part in parts if part not in split] + [fused]
    if config.qk_norm:
        parts += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(config.num_hidden_layers):
        moe = config.is_moe_layer(i)
        names.update(f"model.layers.{i}.{part}" for part in parts if not (moe and part.startswith("mlp.")))
        if moe:
            names.update(hf_layer_names(config, i))
        if config.attention_bias:
            names.update(f"model.layers.{i}.self_attn.{x}_proj.bias" for x in "qkv")
    return names


def check_weight_names(names: list[str], config: ModelConfig) -> None:
    """Refuse checkpoint tensors the model would not read (a bias or norm left out is math left out).

    RoPE's ``rotary_emb.inv_freq`` buffers, which older checkpoints saved, are recomputed and pass.

    Raises:
        ValueError: naming the first unexpected tensors.
    """
    expected = expected_weight_names(config)
    extra = sorted(n for n in names if n not in expected and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(f"checkpoint tensors the engine does not implement: {', '.join(extra[:3])}"
                         + (f" and {len(extra) - 3} more" if len(extra) > 3 else ""))


def load_hf_dir(path: str, dtype: torch.dtype) -> LoadedModel:
    """Load a HF model directory: ``config.json`` (+ ``generation_config.json``), ``*.safetensors``, tokenizer.

    Args:
        path: The directory.
        dtype: Dtype every weight is cast to.

    Returns:
        The :class:`LoadedModel` (weights on CPU, HF names; ``lm_head.weight`` dropped when tied; fused
        projections split).

    Raises:
        FileNotFoundError: If ``config.json`` or the ``*.safetensors`` shards are missing.
        ValueError: On an unsupported architecture or config field, a tensor the model would not read, or an
            untied model without ``lm_head.weight``.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in model directory {path!r}")
    with open(config_path) as f:
        cfg = json.load(f)
    gen_cfg = None
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen_cfg = json.load(f)
    config = hf_config_to_model_config(cfg, gen_cfg)

    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in model directory {path!r}")
    names = []
    for shard in shards:  # headers only
        with safe_open(shard, framework="pt") as f:
            names.extend(f.keys())
    check_weight_names(names, config)
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, tensor in load_file(shard).items():
            weights[name] = tensor.to(dtype)
    split_fused_projections(weights, config)
    stack_experts(weights, config)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        raise ValueError(f"{path!r}: lm_head.weight missing but tie_word_embeddings is false")

    tokenizer = load_hf_tokenizer(path)
    return LoadedModel(config=with_tokenizer_eos(config, tokenizer), weights=weights, tokenizer=tokenizer,
                       chat_template=tokenizer_chat_template(tokenizer))
