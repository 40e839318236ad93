"""llama.cpp's ``deepseek2`` GGUFs (DeepSeek-V2) as the HF ``deepseek_v2`` model: config, tensor names, ``kv_b``.

The conventions are those of llama.cpp's converter (``convert_hf_to_gguf.py``, class ``DeepseekV2Model``) and
of ``gguf-py`` (``MODEL_TENSORS[MODEL_ARCH.DEEPSEEK2]``); the file then runs in
:class:`goodserve.models.deepseek_v2.DeepseekV2ForCausalLM` with the :class:`~goodserve.model_config.ModelConfig`
a HF directory of the same model gives.

* **Tensors.** ``attn_q`` (full-rank query) or ``attn_q_a`` / ``attn_q_a_norm`` / ``attn_q_b`` (with
  ``attention.q_lora_rank``), ``attn_kv_a_mqa`` (``kv_a_proj_with_mqa``), ``attn_kv_a_norm``, ``attn_output``;
  the up-projection either as one ``attn_kv_b`` (``kv_b_proj`` as is; converters before the MLA-absorption
  change) or, as the converter writes it now, split per head into ``attn_k_b`` (``W_UK`` transposed:
  ``[heads, kv_lora_rank, qk_nope_head_dim]`` in torch order) and ``attn_v_b`` (``W_UV``: ``[heads, v_head_dim,
  kv_lora_rank]``), which :func:`join_kv_b` stacks back into ``kv_b_proj``. Dense layers: ``ffn_gate`` /
  ``ffn_up`` / ``ffn_down``; MoE layers: router ``ffn_gate_inp``, routed experts stacked in ``ffn_*_exps`` (as
  ``qwen3moe``, :func:`goodserve.models.moe.join_gguf_experts`) and the shared experts ``ffn_*_shexp``.
* **RoPE.** llama.cpp rotates ``deepseek2`` with its "normal" RoPE (consecutive pairs ``x[2i], x[2i+1]``;
  ``llama_model_rope_type``), which is the interleaved RoPE of transformers' DeepSeek-V2, and the converter
  does not reorder any rows (unlike ``llama``'s ``attn_q`` / ``attn_k``): no tensor is permuted here.
* **Metadata.** ``attention.kv_lora_rank`` / ``q_lora_rank``, ``rope.dimension_count`` (``qk_rope_head_dim``),
  ``attention.key_length_mla`` / ``value_length_mla`` (``qk_nope_head_dim + qk_rope_head_dim``, ``v_head_dim``;
  ``key_length`` / ``value_length`` are then the latent's ``kv_lora_rank + qk_rope_head_dim`` and
  ``kv_lora_rank``; older files carry the per-head widths in ``key_length`` / ``value_length`` and no ``_mla``
  keys), ``leading_dense_block_count`` (``first_k_dense_replace``), ``expert_*`` (routed and shared experts,
  ``expert_weights_scale`` = ``routed_scaling_factor``, ``expert_group_count`` / ``expert_group_used_count`` =
  group-limited routing), and YaRN as ``rope.scaling.type`` ``yarn`` with ``factor``,
  ``original_context_length`` and ``yarn_log_multiplier`` = ``0.1 * mscale_all_dim``.
  The file has one YaRN temperature where HF has two (``mscale`` on cos/sin, ``mscale_all_dim`` on the
  softmax); llama.cpp cancels the cos/sin factor and applies ``(1 + yarn_log_multiplier * ln factor) ** 2`` to
  the scores, which is HF's computation with ``mscale == mscale_all_dim`` (DeepSeek-V2's own configs), so the
  config gets both from the multiplier. A YaRN file without the multiplier is refused (HF's answer would then
  depend on keys the file does not hold).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from goodserve.model_config import ModelConfig
from goodserve.models.field_rule import FieldRule, only, positive_int, refuse_if_set

ARCH = "deepseek2"
_A = (ARCH,)

#: GGUF metadata keys under ``deepseek2.`` that differ from or add to the common GGUF rules.
DEEPSEEK2_GGUF_RULES: tuple[FieldRule, ...] = (
    FieldRule("attention.kv_lora_rank", "implemented", "width of the cached KV latent c_KV", _A, positive_int),
    FieldRule("attention.q_lora_rank", "implemented", "low-rank query (attn_q_a, attn_q_a_norm, attn_q_b); absent: "
              "attn_q", _A, positive_int),
    FieldRule("attention.key_length", "implemented", "kv_lora_rank + qk_rope_head_dim with key_length_mla, else "
              "qk_nope_head_dim + qk_rope_head_dim", _A),
    FieldRule("attention.value_length", "implemented", "kv_lora_rank with value_length_mla, else v_head_dim", _A),
    FieldRule("attention.key_length_mla", "implemented", "qk_nope_head_dim + qk_rope_head_dim", _A),
    FieldRule("attention.value_length_mla", "implemented", "v_head_dim", _A),
    FieldRule("attention.head_count_kv", "ignored", "MLA caches one latent per token, no KV heads (the converter "
              "writes 1, older ones the HF num_key_value_heads)", _A),
    FieldRule("rope.dimension_count", "implemented", "qk_rope_head_dim (decoupled RoPE width)", _A),
    FieldRule("rope.scaling.type", "implemented", "none, yarn", _A,
              only(("none", "yarn"), "only none and yarn RoPE scaling are implemented for deepseek2")),
    FieldRule("rope.scaling.factor", "implemented", "YaRN's factor", _A),
    FieldRule("rope.scaling.original_context_length", "implemented", "YaRN's original context", _A),
    FieldRule("rope.scaling.yarn_log_multiplier", "implemented", "0.1 * mscale_all_dim (= mscale)", _A),
    FieldRule("rope.scaling.yarn_beta_fast", "implemented", "YaRN's beta_fast (default 32)", _A),
    FieldRule("rope.scaling.yarn_beta_slow", "implemented", "YaRN's beta_slow (default 1)", _A),
    FieldRule("leading_dense_block_count", "implemented", "first_k_dense_replace: leading dense-MLP layers", _A),
    FieldRule("expert_count", "implemented", "routed experts per MoE layer", _A),
    FieldRule("expert_used_count", "implemented", "top-k routing (softmax, then top k; not renormalised)", _A),
    FieldRule("expert_feed_forward_length", "implemented", "SwiGLU width of one routed or shared expert", _A),
    FieldRule("expert_shared_count", "implemented", "always-on shared experts", _A),
    FieldRule("expert_weights_scale", "implemented", "routed_scaling_factor", _A),
    FieldRule("expert_group_count", "implemented", "n_group of group-limited routing", _A),
    FieldRule("expert_group_used_count", "implemented", "topk_group of group-limited routing", _A),
    FieldRule("expert_weights_norm", "refused", "transformers' DeepSeek-V2 never renormalises the top-k weights", _A,
              refuse_if_set("renormalised top-k weights (norm_topk_prob) are not implemented for deepseek2")),
    FieldRule("expert_gating_func", "implemented", "1 (softmax); sigmoid (DeepSeek-V3's) refused", _A,
              only((1,), "only softmax gating (1) is implemented for deepseek2; sigmoid scores are DeepSeek-V3's")),
)

#: GGUF layer tensor (after ``blk.N.``) -> HF name (after ``model.layers.N.``), or ``None`` for the common names
#: ``deepseek2`` does not have; merged over :data:`goodserve.models.gguf_file._GGUF_LAYER_NAMES`.
DEEPSEEK2_LAYER_NAMES: dict[str, Optional[str]] = {
    "attn_k": None, "attn_v": None,
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.k_b", "attn_v_b": "self_attn.v_b",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


def deepseek2_fields(get: Callable[[str], Any], num_layers: int, heads: int) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a ``deepseek2`` file that the common GGUF reading does not give.

    Args:
        get: ``key -> value`` of the metadata under ``deepseek2.`` (``None`` when absent).
        num_layers: ``block_count``.
        heads: ``attention.head_count``.

    Returns:
        Keyword arguments: ``architecture`` (``deepseek_v2``), the MLA widths, ``head_dim`` (nope + rope),
        ``num_key_value_heads`` (= heads, as DeepSeek-V2's configs say; MLA does not read it),
        ``intermediate_size``, ``rope_scaling``, and, with a MoE layer, the DeepSeekMoE fields.

    Raises:
        ValueError: naming a missing or inconsistent key.
    """
    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ValueError(f"GGUF metadata {ARCH}.{key} is missing")
        return value

    rank, rope = int(need("attention.kv_lora_rank")), int(need("rope.dimension_count"))
    if get("attention.key_length_mla") is not None:
        qk, v = int(get("attention.key_length_mla")), int(need("attention.value_length_mla"))
        latent = (get("attention.key_length"), get("attention.value_length"))
        if latent != (rank + rope, rank) and latent != (None, None):
            raise ValueError(f"GGUF metadata {ARCH}.attention.key_length/value_length={latent} is not supported: "
                             f"with key_length_mla they are the latent's ({rank + rope}, {rank})")
    else:
        qk, v = int(need("attention.key_length")), int(need("attention.value_length"))
    if qk <= rope:
        raise ValueError(f"GGUF metadata {ARCH}.attention.key_length(_mla)={qk} is not supported: it must exceed "
                         f"rope.dimension_count={rope} (qk_nope_head_dim > 0)")
    q_rank = get("attention.q_lora_rank")
    fields: dict[str, Any] = dict(
        architecture="deepseek_v2", head_dim=qk, num_key_value_heads=heads, kv_lora_rank=rank,
        q_lora_rank=None if not q_rank else int(q_rank), qk_nope_head_dim=qk - rope, qk_rope_head_dim=rope,
        v_head_dim=v, intermediate_size=int(need("feed_forward_length")), norm_topk_prob=False,
        rope_scaling=_yarn(get))
    first_dense = min(int(need("leading_dense_block_count")), num_layers)
    if first_dense == num_layers:
        return fields
    experts, top_k = int(need("expert_count")), int(need("expert_used_count"))
    if not 0 < top_k <= experts:
        raise ValueError(f"GGUF metadata {ARCH}.expert_used_count={top_k} is not supported: expected 1..{experts}")
    groups = (int(get("expert_group_count") or 1), int(get("expert_group_used_count") or 1))
    if groups != (1, 1) and not (experts % groups[0] == 0 and 0 < groups[1] <= groups[0]):
        raise ValueError(f"GGUF metadata {ARCH}.expert_group_count/expert_group_used_count={groups} is not supported: "
                         f"the group count must divide expert_count={experts} and 1 <= used <= count")
    fields.update(num_experts=experts, num_experts_per_tok=top_k, dense_mlp_layers=tuple(range(first_dense)),
                  moe_intermediate_size=int(need("expert_feed_forward_length")),
                  num_shared_experts=int(get("expert_shared_count") or 0),
                  routed_scaling_factor=float(get("expert_weights_scale") or 1.0), expert_groups=groups)
    return fields


def _yarn(get: Callable[[str], Any]) -> Optional[dict[str, Any]]:
    """The HF ``rope_scaling`` dict of the file's YaRN keys (``None`` without scaling); see the module notes."""
    if get("rope.scaling.type") in (None, "none"):
        return None
    log_mul = get("rope.scaling.yarn_log_multiplier")
    missing = [k for k, v in (("factor", get("rope.scaling.factor")), ("yarn_log_multiplier", log_mul),
                              ("original_context_length", get("rope.scaling.original_context_length"))) if not v]
    if missing:
        raise ValueError(f"GGUF metadata {ARCH}.rope.scaling.{missing[0]} is missing: YaRN without it is not "
                         "supported (the file would not say which temperatures to apply)")
    mscale = float(log_mul) / 0.1
    original = int(get("rope.scaling.original_context_length"))
    return {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")), "mscale": mscale,
            "mscale_all_dim": mscale, "original_max_position_embeddings": original,
            "beta_fast": float(get("rope.scaling.yarn_beta_fast") or 32),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow") or 1)}


def deepseek2_expected_names(config: ModelConfig, split_kv_b: bool, empty: frozenset[str] = frozenset()) -> set[str]:
    """GGUF names of every tensor the engine reads for ``config`` (``output.weight`` included): the query as
    ``attn_q`` or the ``attn_q_a`` / ``attn_q_a_norm`` / ``attn_q_b`` trio, ``kv_b`` as ``attn_kv_b`` or (with
    ``split_kv_b``) ``attn_k_b`` + ``attn_v_b``, the dense or MoE MLP per layer. Shared experts (``ffn_*_shexp``)
    when ``num_shared_experts``; without, only the file's ``empty`` (zero-element) ones pass: the converter
    copies the zero-row tensors transformers saves for ``n_shared_experts = 0``."""
    names = {"token_embd.weight", "output_norm.weight", "output.weight"}
    attn = ["attn_norm", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_output", "ffn_norm"]
    attn += ["attn_q"] if config.q_lora_rank is None else ["attn_q_a", "attn_q_a_norm", "attn_q_b"]
    attn += ["attn_k_b", "attn_v_b"] if split_kv_b else ["attn_kv_b"]
    for i in range(config.num_hidden_layers):
        parts = list(attn)
        if not config.is_moe_layer(i):
            parts += ["ffn_gate", "ffn_up", "ffn_down"]
        else:
            parts += ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
            shared = [f"blk.{i}.ffn_{w}_shexp.weight" for w in ("gate", "up", "down")]
            names.update(n for n in shared if config.num_shared_experts or n in empty)
        names.update(f"blk.{i}.{part}.weight" for part in parts)
    return names


def join_kv_b(weights: dict[str, Any], config: ModelConfig) -> None:
    """Replace, in place, each layer's split ``k_b`` (``[heads, kv_lora_rank, qk_nope_head_dim]``) and ``v_b``
    (``[heads, v_head_dim, kv_lora_rank]``) by HF's ``kv_b_proj`` (``[heads * (nope + v_head_dim),
    kv_lora_rank]``, each head's ``W_UK`` rows then its ``W_UV`` rows), undoing the converter's split and
    transposition. A no-op for a file with ``attn_kv_b``.

    Raises:
        ValueError: naming a half of the pair that is missing or of the wrong shape.
    """
    import torch

    heads, rank = config.num_attention_heads, config.kv_lora_rank
    nope, v = config.qk_nope_head_dim, config.v_head_dim
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        if p + "k_b.weight" not in weights and p + "v_b.weight" not in weights:
            continue
        for name, shape in ((p + "k_b.weight", (heads, rank, nope)), (p + "v_b.weight", (heads, v, rank))):
            if name not in weights or tuple(weights[name].shape) != shape:
                got = tuple(weights[name].shape) if name in weights else "missing"
                raise ValueError(f"weight {name!r} (GGUF attn_{name.split('.')[-2]}) is {got}, expected {shape}")
        k_b, v_b = weights.pop(p + "k_b.weight"), weights.pop(p + "v_b.weight")
        weights[p + "kv_b_proj.weight"] = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, rank).contiguous()
