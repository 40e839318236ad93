"""Read a Hugging Face model directory: ``config.json``, safetensors shards and the tokenizer.

``config.json`` is parsed by :meth:`goodserve.config.ModelConfig.from_hf_config` (shared with the
simulator's presets); this module adds what the engine can run: Llama-family decoders with a SwiGLU MLP
and RMSNorm, without MLP biases.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any, Optional

import torch

from goodserve.config import ModelConfig, hf_model_type
from goodserve.models.checkpoint import LoadedModel, load_hf_tokenizer, tokenizer_chat_template, with_tokenizer_eos

logger = logging.getLogger(__name__)

#: HF ``model_type`` values we can run (all Llama-family decoders with SwiGLU MLP and RMSNorm).
SUPPORTED_HF_ARCHITECTURES = ("llama", "mistral", "qwen2")


def hf_config_to_model_config(cfg: dict[str, Any], generation_cfg: Optional[dict[str, Any]] = None) -> ModelConfig:
    """Build the :class:`ModelConfig` of a model the engine can run from a parsed HF ``config.json``.

    Parsing is :meth:`ModelConfig.from_hf_config`'s; this adds what the engine supports.

    Args:
        cfg: The ``config.json`` contents.
        generation_cfg: The ``generation_config.json`` contents, if any; its EOS ids are merged in.

    Returns:
        The model config.

    Raises:
        ValueError: On an unsupported architecture or feature (MLP bias), or a missing required key.
    """
    model_type = hf_model_type(cfg)
    if model_type not in SUPPORTED_HF_ARCHITECTURES:
        named = model_type or cfg.get("architectures")
        raise ValueError(
            f"unsupported architecture {named!r}; supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
        )
    if cfg.get("mlp_bias"):
        raise ValueError("MLP biases (mlp_bias=true) are not supported")
    if model_type == "mistral" and cfg.get("sliding_window"):
        logger.warning("sliding_window=%s is ignored: full attention is used", cfg["sliding_window"])
    return ModelConfig.from_hf_config(cfg, generation_cfg)


def load_hf_dir(path: str, dtype: torch.dtype) -> LoadedModel:
    """Load a HF model directory: ``config.json`` (+ ``generation_config.json``), ``*.safetensors``, tokenizer.

    Args:
        path: The directory.
        dtype: Dtype every weight is cast to.

    Returns:
        The :class:`LoadedModel` (weights on CPU, HF names; ``lm_head.weight`` dropped when tied).

    Raises:
        FileNotFoundError: If ``config.json`` or the ``*.safetensors`` shards are missing.
        ValueError: On an unsupported architecture, or an untied model without ``lm_head.weight``.
    """
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
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, tensor in load_file(shard).items():
            weights[name] = tensor.to(dtype)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        raise ValueError(f"{path!r}: lm_head.weight missing but tie_word_embeddings is false")

    tokenizer = load_hf_tokenizer(path)
    return LoadedModel(config=with_tokenizer_eos(config, tokenizer), weights=weights, tokenizer=tokenizer,
                       chat_template=tokenizer_chat_template(tokenizer))
