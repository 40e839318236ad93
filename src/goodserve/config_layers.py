"""Which layers of a HF config attend within a window, and Gemma 3's per-layer-type RoPE, as transformers reads them.

Parsing only (no torch): :meth:`goodserve.config.ModelConfig.from_hf_config` calls these. A window ``W`` lets a
query at position ``p`` attend positions ``p - W + 1 .. p`` (transformers' ``sliding_window_overlay``:
``kv_idx > q_idx - W``; Mistral 7B, Jiang et al. 2023, §2; Gemma 3 technical report, §2, local layers).
"""

from __future__ import annotations

from typing import Any, Optional

FULL, SLIDING = "full_attention", "sliding_attention"
#: Model types the engine runs whose ``sliding_window`` covers every layer, whatever ``layer_types`` says.
EVERY_LAYER_TYPES = ("mistral", "phi3", "mixtral", "qwen3_moe")
#: Gemma 3's default local:global pattern: every sixth layer is global (transformers' ``sliding_window_pattern``).
GEMMA3_PATTERN = 6


def hf_layer_types(cfg: dict[str, Any], model_type: str) -> tuple[str, ...]:
    """Per layer, ``"full_attention"`` or ``"sliding_attention"`` as transformers 5 applies ``sliding_window``;
    ``()`` when no layer applies a window.

    ``llama`` never applies ``sliding_window``; ``mistral``, ``phi3`` and ``mixtral`` apply it to every layer,
    ``qwen3_moe`` to every layer with ``use_sliding_window`` true; ``qwen2`` and ``qwen3`` only with
    ``use_sliding_window`` true, on the layers ``layer_types`` marks (by default those at index
    ``>= max_window_layers``, default 28); ``gemma3_text`` on the layers ``layer_types`` marks (by default all but
    every ``sliding_window_pattern``-th, default 6). Other model types (read only by the simulator) apply it to
    the layers ``layer_types`` marks when the config lists them; else another Qwen2/Qwen3 type (not
    ``qwen3_moe``) to those at index ``>= max_window_layers``, another Gemma type (Gemma 2) to all but every
    ``sliding_window_pattern``-th (default 1: none), and any other type to every layer.

    Args:
        cfg: The ``config.json`` contents (defaults of the model type merged in).
        model_type: Its ``model_type``.
    """
    window = cfg.get("sliding_window")
    num_layers = int(cfg.get("num_hidden_layers", 0))
    if not window or model_type == "llama":
        return ()
    types = cfg.get("layer_types")
    if model_type.startswith(("qwen2", "qwen3")) and not cfg.get("use_sliding_window", False):
        return ()
    if model_type == "gemma3_text" and types is None:
        pattern = int(cfg.get("sliding_window_pattern", GEMMA3_PATTERN))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    elif model_type.startswith(("qwen2", "qwen3")) and model_type != "qwen3_moe" and types is None:
        first = int(cfg.get("max_window_layers", 28))
        types = [SLIDING if i >= first else FULL for i in range(num_layers)]
    elif model_type.startswith("gemma") and types is None:
        pattern = int(cfg.get("sliding_window_pattern") or 1)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    elif model_type in EVERY_LAYER_TYPES or types is None:
        types = [SLIDING] * num_layers
    types = tuple(str(t) for t in types)
    return types if SLIDING in types else ()


def hf_rope_per_layer_type(cfg: dict[str, Any]) -> tuple[dict[str, Any], Optional[float]]:
    """Gemma 3's RoPE: ``cfg`` with the global layers' parameters as the flat ``rope_theta`` / ``rope_scaling``
    every other model type has, and the local layers' base.

    transformers 5 writes ``rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}``; older
    configs give ``rope_theta`` (global, default 1e6), ``rope_scaling`` (global only) and
    ``rope_local_base_freq`` (default 1e4).

    Returns:
        ``(cfg', local_theta)``.
    """
    params = cfg.get("rope_parameters")
    local = float(cfg.get("rope_local_base_freq", 10000.0))
    out = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_local_base_freq")}
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        full = dict(params.get(FULL) or {})
        local = float((params.get(SLIDING) or {}).get("rope_theta", local))
        if "rope_theta" in full:
            out["rope_theta"] = full.pop("rope_theta")
        if full.get("rope_type", "default") != "default" and out.get("rope_scaling") is None:
            out["rope_scaling"] = full
    elif isinstance(params, dict):
        out["rope_parameters"] = params
    return out, local
