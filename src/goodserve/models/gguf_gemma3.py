"""Gemma 3 text from a llama.cpp GGUF (``general.architecture`` ``gemma3``): what differs from the Llama-family
GGUF conventions of :mod:`goodserve.models.gguf_file`, so the file loads into
:class:`goodserve.models.gemma3.Gemma3ForCausalLM` with the :class:`~goodserve.model_config.ModelConfig` a HF
directory of the same model gives (``architecture == "gemma3_text"``).

What llama.cpp's converter (``convert_hf_to_gguf.py``, class ``Gemma3Model``) writes and its loader
(``src/llama-model.cpp``, ``LLM_ARCH_GEMMA3``) assumes:

* Tensor names: ``attn_norm`` (input norm), ``post_attention_norm``, ``ffn_norm`` (the *pre*-feed-forward norm,
  not Llama's post-attention norm), ``post_ffw_norm``, ``attn_q_norm`` / ``attn_k_norm``; q/k rows are not
  reordered (only the converter's ``llama`` family permutes them). The LM head is tied to ``token_embd``.
* Every RMSNorm weight is stored as ``1 + w``: the converter adds 1 to each tensor whose HF name ends in
  ``norm.weight`` (the four per-layer norms, q/k norms and the final norm), since ``Gemma3RMSNorm`` scales by
  ``1 + w`` and llama.cpp's RMSNorm multiplies by the stored weight. :func:`hf_norm_weight` subtracts it again,
  so the model applies HF's ``1 + w`` unchanged.
* Which layers slide: llama.cpp's loader has every sixth layer global (``set_swa_pattern(6)``: layer ``i``
  slides when ``i % 6 < 5``, as HF's ``sliding_window_pattern = 6``), with no scaling on the local layers. Their
  RoPE base is ``rope.freq_base_swa``, which current converters write (HF's ``rope_local_base_freq``) and
  current llama.cpp reads; files without it get the 10000 older llama.cpp hard-codes. A missing or zero
  ``attention.sliding_window`` means every layer is global. ``rope.freq_base`` and any (linear)
  ``rope.scaling`` are the global layers'.
* The score scale is ``key_length ** -0.5``, except for the 62-layer (27B) model, whose is
  ``(embedding_length // head_count) ** -0.5``: HF's ``query_pre_attn_scalar`` is derived the same way.

Keys the engine cannot honour (logit soft-capping, another ``attention.sliding_window_pattern``) are refused by
:mod:`goodserve.models.config_support` before any weight is read.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

#: GGUF ``general.architecture`` of Gemma 3 text and the HF ``model_type`` it runs as.
GGUF_GEMMA3, HF_GEMMA3 = "gemma3", "gemma3_text"
#: llama.cpp's Gemma 3 layout (every ``SWA_PATTERN``-th layer global) and the local RoPE base older llama.cpp fixes.
SWA_PATTERN, LOCAL_ROPE_BASE = 6, 10000.0
#: Layers of Gemma 3 27B, whose score scale llama.cpp takes from ``embedding_length / head_count``.
_LAYERS_27B = 62

#: GGUF layer tensor name (after ``blk.N.``) -> HF name (after ``model.layers.N.``) where Gemma 3 differs
#: from the Llama-family table of :mod:`goodserve.models.gguf_file`.
GEMMA3_GGUF_LAYER_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def llamacpp_swa_layers(num_layers: int) -> tuple[bool, ...]:
    """Per layer, whether llama.cpp's ``gemma3`` slides it (``set_swa_pattern(6)``: all but every sixth)."""
    return tuple(i % SWA_PATTERN < SWA_PATTERN - 1 for i in range(num_layers))


def swa_pattern_problem(value: Any) -> Optional[str]:
    """Why an ``attention.sliding_window_pattern`` key cannot be honoured, or ``None``.

    Only a key saying what :func:`llamacpp_swa_layers` slides (the period 6, or that per-layer list of booleans,
    true = sliding) is accepted: older llama.cpp ignores the key and slides those layers whatever it says.
    """
    if isinstance(value, (list, tuple)):
        same = tuple(bool(v) for v in value) == llamacpp_swa_layers(len(value))
    else:
        same = value == SWA_PATTERN
    return None if same else (f"only llama.cpp's gemma3 layout (every {SWA_PATTERN}th layer global) is "
                              "implemented")


def gemma3_config_fields(get: Any, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """The Gemma 3 fields of :class:`~goodserve.model_config.ModelConfig` from a ``gemma3`` GGUF's metadata.

    Args:
        get: ``key -> value`` of the file's ``gemma3.`` metadata (``None`` when absent), key without the prefix.
        hidden: ``embedding_length``.
        heads: ``attention.head_count``.
        head_dim: ``attention.key_length``.

    Returns:
        ``layer_types``, ``sliding_window``, ``rope_local_theta`` and ``query_pre_attn_scalar`` as llama.cpp
        runs the file (module docstring).
    """
    layers = int(get("block_count"))
    window = int(get("attention.sliding_window") or 0)
    scalar = float(hidden // heads if layers == _LAYERS_27B else head_dim)
    if window <= 0:  # llama.cpp: no SWA, every layer global with rope.freq_base
        return dict(layer_types=("full_attention",) * layers, sliding_window=None, rope_local_theta=None,
                    query_pre_attn_scalar=scalar)
    kinds = tuple("sliding_attention" if swa else "full_attention" for swa in llamacpp_swa_layers(layers))
    return dict(layer_types=kinds, sliding_window=window,
                rope_local_theta=float(get("rope.freq_base_swa") or LOCAL_ROPE_BASE),
                query_pre_attn_scalar=scalar)


def hf_norm_weight(array: np.ndarray) -> np.ndarray:
    """A ``gemma3`` GGUF norm weight (``1 + w``, as llama.cpp's converter stores it) as HF's ``w``, float64 so the
    subtraction adds no rounding of its own before the cast to the model's dtype."""
    return np.asarray(array, dtype=np.float64) - 1.0
