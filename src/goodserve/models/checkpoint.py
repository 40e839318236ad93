"""What loading a checkpoint yields, and the steps every checkpoint format shares.

:class:`LoadedModel` is the result of :func:`goodserve.models.loader.load_model`, whichever format the
weights came in (:mod:`~goodserve.models.hf_dir`, :mod:`~goodserve.models.gguf_file`). Both formats ship
a tokenizer, read here with ``transformers``, whose EOS id joins the config's and which may carry the
chat template. Both may hold Phi-3's fused projections, split here into the names the model reads
(:func:`split_fused_projections`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from goodserve.model_config import ModelConfig, unique_ids
from goodserve.models.quant import BlockQuantized, dequantize_rows

#: Architectures whose checkpoints fuse q/k/v into ``self_attn.qkv_proj`` and gate/up into ``mlp.gate_up_proj``
#: (HF names; llama.cpp's ``attn_qkv`` and ``ffn_up``).
FUSED_PROJECTIONS = ("phi3",)


@dataclass
class LoadedModel:
    """Everything the engine needs from a checkpoint.

    Attributes:
        config: The architecture.
        weights: HF parameter name -> tensor in the requested dtype on CPU. Linear weights are
            ``[out_features, in_features]``; ``lm_head.weight`` is absent when embeddings are tied.
        tokenizer: A ``transformers`` fast tokenizer, or for a GGUF with a GPT-2-style vocabulary a
            :class:`~goodserve.models.gguf_tokenizer.GGUFTokenizer` (the same API, transformers built on demand).
        chat_template: Jinja chat template, or ``None`` if the checkpoint has none.
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Any
    chat_template: Optional[str]


def load_hf_tokenizer(path: str) -> Any:
    """The ``transformers`` fast tokenizer of a HF model directory (``AutoTokenizer``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_gguf_tokenizer(path: str) -> Any:
    """The ``transformers`` fast tokenizer embedded in a GGUF file."""
    # PreTrainedTokenizerFast reads only the tokenizer metadata (~0.5 s); AutoTokenizer would first parse
    # the whole file again to build a model config (~3 s) and ends up with the same class and vocabulary.
    from transformers import PreTrainedTokenizerFast

    path = os.path.abspath(path)
    return PreTrainedTokenizerFast.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def with_tokenizer_eos(config: ModelConfig, tokenizer: Any) -> ModelConfig:
    """``config`` with the tokenizer's EOS id added to its EOS ids (no repeats, config's first)."""
    eos = list(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.append(int(tokenizer.eos_token_id))
    return dataclasses.replace(config, eos_token_ids=unique_ids(eos))


def tokenizer_chat_template(tokenizer: Any) -> Optional[str]:
    """The tokenizer's Jinja chat template, or ``None`` when it has none."""
    return getattr(tokenizer, "chat_template", None)


def fused_projection_sizes(config: ModelConfig) -> dict[str, tuple[list[str], list[int]]]:
    """Per fused HF tensor name within a layer, the names it splits into and their rows (``[q; k; v]``,
    ``[gate; up]``); empty unless ``config.architecture`` is in :data:`FUSED_PROJECTIONS`."""
    if config.architecture not in FUSED_PROJECTIONS:
        return {}
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    return {"self_attn.qkv_proj.weight": (["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                           "self_attn.v_proj.weight"], [q, kv, kv]),
            "mlp.gate_up_proj.weight": (["mlp.gate_proj.weight", "mlp.up_proj.weight"], [inter, inter])}


def split_fused_projections(weights: dict[str, Union[torch.Tensor, BlockQuantized]], config: ModelConfig) -> None:
    """Replace, in place, each layer's fused ``qkv_proj`` (``[q_size + 2 * kv_size, hidden]``, rows q then k
    then v) and ``gate_up_proj`` (``[2 * intermediate, hidden]``, rows gate then up) by the separate
    ``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_proj`` / ``up_proj`` weights (row views; GGUF blocks stay
    blocks), the layout :meth:`goodserve.models.llama.LlamaForCausalLM.load_weights` reads. A no-op for an
    architecture that does not fuse them.

    Raises:
        ValueError: naming a fused tensor that is missing or has the wrong shape.
    """
    hidden = config.hidden_size
    for fused, (names, sizes) in fused_projection_sizes(config).items():
        for i in range(config.num_hidden_layers):
            name = f"model.layers.{i}.{fused}"
            if name not in weights:
                raise ValueError(f"weight {name!r} missing from the checkpoint")
            value = weights.pop(name)
            if tuple(value.shape) != (sum(sizes), hidden):
                raise ValueError(f"weight {name!r} has shape {tuple(value.shape)}, expected {(sum(sizes), hidden)}")
            parts = value.split_rows(sizes) if isinstance(value, BlockQuantized) else value.split(sizes)
            weights.update((f"model.layers.{i}.{part}", w) for part, w in zip(names, parts))


def take_weight(weights: dict[str, Any], name: str, shape: tuple[int, ...]) -> Union[torch.Tensor, BlockQuantized]:
    """``weights[name]``, as stored (a GGUF's blocks stay blocks), checked against ``shape``.

    Raises:
        ValueError: the weight is missing or has another shape (both named).
    """
    if name not in weights:
        raise ValueError(f"weight {name!r} missing from the checkpoint")
    value = weights[name]
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"weight {name!r} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    return value


def dense_weight(weights: dict[str, Any], name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """:func:`take_weight`, dequantized (a GGUF's blocks) and cast to ``dtype``.

    Raises:
        ValueError: as :func:`take_weight`.
    """
    value = take_weight(weights, name, shape)
    return (dequantize_rows(value, dtype) if isinstance(value, BlockQuantized) else value).to(dtype)
