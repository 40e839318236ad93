"""The DeepSeek-V2 fields of :class:`goodserve.config.ModelConfig`, read from a HF ``config.json``.

DeepSeek-V2 (arXiv:2405.04434) differs from the Llama family in two places: multi-head latent attention
(§2.1: ``kv_lora_rank``, ``q_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``) and the
DeepSeekMoE MLP (§2.2: ``n_routed_experts`` routed experts of width ``moe_intermediate_size``, the top
``num_experts_per_tok`` of a softmax, optionally only from the best ``topk_group`` of ``n_group`` expert
groups, scaled by ``routed_scaling_factor``, plus ``n_shared_experts`` always-on experts), on every layer from
``first_k_dense_replace`` on. No torch here.
"""

from __future__ import annotations

from typing import Any


def hf_deepseek_fields(cfg: dict[str, Any]) -> tuple[dict[str, Any], int, tuple[int, ...]]:
    """The MLA and DeepSeekMoE fields of a DeepSeek-V2 ``config.json`` (transformers' defaults applied).

    Args:
        cfg: The ``config.json`` contents.

    Returns:
        ``(fields, num_experts, dense_mlp_layers)``: ``fields`` are :class:`~goodserve.config.ModelConfig`
        keyword arguments (``head_dim`` = ``qk_nope_head_dim + qk_rope_head_dim`` included); ``num_experts`` is
        ``n_routed_experts``, or 0 when no layer is a MoE layer (``first_k_dense_replace >= num_hidden_layers``);
        ``dense_mlp_layers`` the layers before ``first_k_dense_replace`` (empty without experts).
    """
    q_rank = cfg.get("q_lora_rank")
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    fields: dict[str, Any] = dict(
        kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=None if q_rank is None else int(q_rank),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(cfg["v_head_dim"]), head_dim=nope + rope)
    num_layers = int(cfg["num_hidden_layers"])
    first_dense = min(int(cfg.get("first_k_dense_replace") or 0), num_layers)
    if first_dense == num_layers:
        return fields, 0, ()
    grouped = cfg.get("topk_method", "greedy") == "group_limited_greedy"
    fields.update(num_shared_experts=int(cfg.get("n_shared_experts") or 0),
                  routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                  expert_groups=(int(cfg["n_group"]), int(cfg["topk_group"])) if grouped else (1, 1))
    return fields, int(cfg.get("n_routed_experts") or 0), tuple(range(first_dense))
