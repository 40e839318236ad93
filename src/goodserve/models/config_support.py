"""What the engine implements of a checkpoint's config, decided before any weight is read.

Every field the loaders meet in a HF ``config.json`` (:data:`HF_RULES`) or in GGUF metadata
(:data:`GGUF_RULES`, keys under the file's architecture) has one handling:

* ``implemented``: the engine computes what the field asks (tests compare with transformers token for token);
* ``capped``: exact only up to a length, so ``max_model_len`` is capped there (:func:`exact_context_len`);
* ``refused``: a ``ValueError`` names the field, its value and what is supported, before any weight is read;
* ``ignored``: the field cannot change the output at inference (dropout, ``use_cache``, dtypes, names), or
  transformers' class for that ``model_type`` does not read it either, so the engine's output still equals
  the reference's.

A rule with a ``problem`` check is refused for the values the check names and has its ``handling`` for the
others (``hidden_act`` is implemented for ``silu`` and refused otherwise). A HF key in no table is logged at
WARNING (configs carry free-form metadata); a GGUF key under ``{arch}.`` in no table is refused, because
that namespace holds only hyperparameters (ggml ``docs/gguf.md``). GGUF tensors the engine has no use for are
refused too (:func:`check_gguf_tensors`): a skipped tensor is skipped math.

Layers attend within the window a HF config gives them (``ModelConfig.layer_window``; the windowed attention
of :mod:`goodserve.models.window_attention`), so a HF checkpoint's ``sliding_window`` is implemented past the
window. A GGUF's ``attention.sliding_window`` is applied to every layer too, but that placement is not checked
against llama.cpp, so :func:`exact_context_len` (the one place that says how far the output is exact) still
caps ``max_model_len`` to such a window; a ``gemma3`` GGUF's layers slide as llama.cpp slides them
(:mod:`goodserve.models.gguf_gemma3`), given as ``layer_types``, so its window is implemented past the window.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

from goodserve.model_config import HF_REQUIRED_KEYS, ModelConfig
from goodserve.models.field_rule import FieldRule, not_one, only, positive_int, refuse_if_set
from goodserve.models.gguf_deepseek2 import DEEPSEEK2_GGUF_RULES
from goodserve.models.gguf_gemma3 import swa_pattern_problem

logger = logging.getLogger(__name__)

#: RoPE types the model computes (``goodserve.models.llama.rope_inv_freq``), as transformers names them.
ROPE_TYPES = ("default", "linear", "llama3")
#: ``hidden_act`` values of the SwiGLU MLP (transformers' ``swish`` is ``nn.SiLU``).
ACTIVATIONS = ("silu", "swish")



def _rope_problem(value: Any) -> Optional[str]:
    """What of a HF ``rope_scaling`` / ``rope_parameters`` dict the engine does not compute, or ``None``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return "expected a dict"
    if any(isinstance(v, dict) for v in value.values()):
        return "RoPE parameters per layer type are not implemented"
    kind = value.get("rope_type", value.get("type", "default"))
    if kind not in ROPE_TYPES:
        return f"rope_type {kind!r} is not implemented (supported: {', '.join(ROPE_TYPES)})"
    factor = value.get("partial_rotary_factor")
    if factor is not None and float(factor) != 1.0:
        return "partial_rotary_factor != 1 (rotary on part of each head) is not implemented"
    needed = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
    missing = [key for key in needed[kind] if key not in value]
    return f"rope_type {kind!r} needs {missing[0]!r}" if missing else None


def _layer_types_problem(value: Any) -> Optional[str]:
    kinds = set(value or ()) - {"full_attention", "sliding_attention"}
    return f"layer types {sorted(kinds)} are not implemented" if kinds else None


def _window_problem(value: Any) -> Optional[str]:
    return None if value is None or (isinstance(value, int) and value > 0) else "expected a positive int or null"


_NOT_READ = "transformers' class for this model_type does not read it, so the reference output ignores it too"
_METADATA = "metadata: no effect on the computed tokens"


def _mla_rope_problem(value: Any) -> Optional[str]:
    """What of DeepSeek-V2's RoPE dict the MLA model does not compute (default and yarn are implemented)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return "expected a dict"
    kind = value.get("rope_type", value.get("type", "default"))
    if kind not in ("default", "yarn"):
        return f"rope_type {kind!r} is not implemented for multi-head latent attention (supported: default, yarn)"
    if kind == "yarn" and not value.get("factor"):
        return "rope_type 'yarn' needs 'factor'"
    factor = value.get("partial_rotary_factor")
    return None if factor is None or float(factor) == 1.0 else "partial_rotary_factor != 1 is not implemented"


#: DeepSeek-V2 (``deepseek_v2``): multi-head latent attention and DeepSeekMoE (:mod:`goodserve.models.deepseek_v2`);
#: uneven expert groups are refused by :func:`goodserve.models.hf_dir.check_deepseek_v2_groups`.
DEEPSEEK_V2_RULES: tuple[FieldRule, ...] = (
    *(FieldRule(key, "implemented", what, ("deepseek_v2",), positive_int) for key, what in (
        ("kv_lora_rank", "width of the cached KV latent c_KV (DeepSeek-V2 §2.1.2)"),
        ("qk_nope_head_dim", "per-head query/key width without RoPE"),
        ("qk_rope_head_dim", "decoupled RoPE width of each query head and of the shared cached key (§2.1.3)"),
        ("v_head_dim", "per-head value width"))),
    FieldRule("q_lora_rank", "implemented", "low-rank query (q_a_proj, q_a_layernorm, q_b_proj); null: q_proj",
              ("deepseek_v2",), lambda v: None if v is None else positive_int(v)),
    FieldRule("first_k_dense_replace", "implemented", "leading layers with the dense MLP; MoE layers after",
              ("deepseek_v2",)),
    FieldRule("n_routed_experts", "implemented", "routed experts per MoE layer", ("deepseek_v2",), positive_int),
    FieldRule("num_experts_per_tok", "implemented", "top-k routing (float32 softmax, then top k; 1..n_routed_experts "
              "checked with a MoE layer)", ("deepseek_v2",)),
    FieldRule("moe_intermediate_size", "implemented", "SwiGLU width of one routed or shared expert", ("deepseek_v2",)),
    FieldRule("n_shared_experts", "implemented", "always-on experts: one SwiGLU n_shared_experts times as wide",
              ("deepseek_v2",)),
    FieldRule("routed_scaling_factor", "implemented", "factor on the routed experts' weights", ("deepseek_v2",)),
    FieldRule("topk_method", "implemented", "greedy, group_limited_greedy", ("deepseek_v2",),
              only(("greedy", "group_limited_greedy"), "only greedy and group_limited_greedy are implemented")),
    FieldRule("n_group", "implemented", "expert groups of group_limited_greedy", ("deepseek_v2",)),
    FieldRule("topk_group", "implemented", "groups a token routes within (group_limited_greedy)", ("deepseek_v2",)),
    FieldRule("norm_topk_prob", "refused", "transformers' DeepSeek-V2 never renormalises the top-k weights, DeepSeek's "
              "own code does with it true: only false is unambiguous", ("deepseek_v2",),
              refuse_if_set("renormalised top-k weights are not implemented for deepseek_v2")),
    FieldRule("output_router_logits", "ignored", "router logits feed the training loss only", ("deepseek_v2",)),
    FieldRule("head_dim", "ignored", "transformers sets it to qk_rope_head_dim whatever the file says",
              ("deepseek_v2",)),
    FieldRule("qk_head_dim", "ignored", "derived: qk_nope_head_dim + qk_rope_head_dim", ("deepseek_v2",)),
    FieldRule("num_key_value_heads", "ignored", "MLA caches one latent per token, no KV heads; every head's K and V "
              "are re-projected from it", ("deepseek_v2",)),
    FieldRule("rope_scaling", "implemented", "default or yarn RoPE (with mscale / mscale_all_dim); others refused",
              ("deepseek_v2",), _mla_rope_problem),
    FieldRule("rope_parameters", "implemented", "rope_theta with default or yarn RoPE; others refused",
              ("deepseek_v2",), _mla_rope_problem),
    FieldRule("attention_bias", "refused", "q_a / kv_a / o_proj biases are not implemented", ("deepseek_v2",),
              refuse_if_set("attention biases on a deepseek_v2 model are not implemented")),
    FieldRule("mlp_bias", "refused", "MLP biases are not implemented", ("deepseek_v2",),
              refuse_if_set("MLP biases are not implemented")),
)


#: HF ``config.json`` keys of the ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``phi3``, ``mixtral``, ``qwen3_moe``
#: and ``deepseek_v2`` model types (SmolLM2 is ``llama``).
HF_RULES: tuple[FieldRule, ...] = (
    *(FieldRule(key, "implemented", "required shape") for key in HF_REQUIRED_KEYS),
    FieldRule("num_key_value_heads", "implemented", "GQA / MQA; default num_attention_heads (qwen3: 32)"),
    FieldRule("head_dim", "implemented", "any width, also != hidden_size / num_attention_heads (qwen3 default: 128)"),
    FieldRule("max_position_embeddings", "implemented", "caps max_model_len; sizes the RoPE table"),
    FieldRule("rms_norm_eps", "implemented", "RMSNorm epsilon (also of qwen3's q/k norms)"),
    FieldRule("rope_theta", "implemented", "RoPE base"),
    FieldRule("rope_scaling", "implemented", f"rope_type {', '.join(ROPE_TYPES)}; others refused (phi3's "
              "longrope / su included)", problem=_rope_problem),
    FieldRule("rope_parameters", "implemented", "transformers-5 layout of rope_theta + rope_scaling",
              problem=_rope_problem),
    FieldRule("original_max_position_embeddings", "ignored", "at top level transformers' RoPE does not read it "
              "(llama3 reads the rope dict's, implemented)"),
    FieldRule("original_max_position_embeddings", "ignored", "only phi3's longrope (refused) reads it; else "
              "transformers' generate merely drops its KV cache once past it and recomputes the same logits",
              ("phi3",)),
    FieldRule("partial_rotary_factor", "refused", "rotary on part of each head is not implemented",
              problem=not_one("only 1.0 (rotary on the whole head) is implemented")),
    FieldRule("hidden_act", "implemented", "SwiGLU with silu (= swish)",
              problem=only(ACTIVATIONS, f"only {', '.join(ACTIVATIONS)} is implemented")),
    FieldRule("tie_word_embeddings", "implemented", "LM head = embedding"),
    FieldRule("bos_token_id", "implemented", "BOS id"),
    FieldRule("eos_token_id", "implemented", "EOS ids (with generation_config.json's)"),
    FieldRule("attention_bias", "refused", "transformers' Llama then adds q/k/v and o_proj biases; the engine has "
              "no o_proj bias", ("llama",), refuse_if_set("attention biases on a llama model are not implemented")),
    *(FieldRule("attention_bias", "refused", f"transformers' {name} then adds q/k/v and o_proj biases; the engine "
                "has no o_proj bias", (kind,), refuse_if_set(f"attention biases on a {kind} model are not "
                                                                "implemented"))
      for kind, name in (("qwen3", "Qwen3"), ("qwen3_moe", "Qwen3-MoE"))),
    FieldRule("attention_bias", "ignored", "Qwen2 always has q/k/v biases and no o_proj bias (implemented)",
              ("qwen2",)),
    FieldRule("attention_bias", "ignored", "transformers' Mistral, Phi-3 and Mixtral have no biases whatever the key "
              "says", ("mistral", "phi3", "mixtral")),
    FieldRule("mlp_bias", "refused", "MLP biases are not implemented", ("llama",),
              refuse_if_set("MLP biases are not implemented")),
    FieldRule("mlp_bias", "ignored", _NOT_READ, ("mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe")),
    FieldRule("sliding_window", "implemented", "every layer attends within W tokens (q - W < k <= q)",
              ("mistral", "phi3", "mixtral"), _window_problem),
    FieldRule("sliding_window", "implemented", "every layer attends within W tokens with use_sliding_window",
              ("qwen3_moe",), _window_problem),
    FieldRule("sliding_window", "implemented", "applied only with use_sliding_window, on the sliding layers",
              ("qwen2", "qwen3"), _window_problem),
    FieldRule("sliding_window", "ignored", _NOT_READ, ("llama",)),
    FieldRule("use_sliding_window", "implemented", "false: transformers ignores sliding_window (full context)",
              ("qwen2", "qwen3", "qwen3_moe")),
    FieldRule("max_window_layers", "implemented", "layers at index >= it slide (when layer_types is absent)",
              ("qwen2", "qwen3")),
    FieldRule("max_window_layers", "ignored", _NOT_READ, ("qwen3_moe",)),
    FieldRule("layer_types", "implemented", "full_attention / sliding_attention per layer", ("qwen2", "qwen3"),
              _layer_types_problem),
    FieldRule("layer_types", "ignored", _NOT_READ, ("llama", "mistral", "phi3", "mixtral", "qwen3_moe")),
    FieldRule("quantization_config", "refused", "quantized safetensors are not implemented (GGUF blocks are)",
              problem=refuse_if_set("quantized safetensors checkpoints (GPTQ, AWQ, bitsandbytes, fp8) are not "
                                     "implemented; use an unquantized checkpoint or a GGUF")),
    FieldRule("rope_interleaved", "refused", "GPT-J-style interleaved RoPE is not implemented (rotate-half is)",
              problem=refuse_if_set("interleaved RoPE is not implemented")),
    *(FieldRule(key, "refused", f"{what} is not implemented", problem=refuse_if_set(f"{what} is not implemented"))
      for key, what in (("attn_logit_softcapping", "attention logit soft-capping"),
                        ("final_logit_softcapping", "final logit soft-capping"),
                        ("qk_norm", "q/k normalisation"), ("use_qk_norm", "q/k normalisation"),
                        ("num_local_experts", "a mixture of experts"), ("num_experts", "a mixture of experts"))),
    # Mixtures of experts (goodserve.models.moe); the refusals above hold for the dense model types.
    FieldRule("num_local_experts", "implemented", "routed experts per MoE layer", ("mixtral", "qwen3_moe"),
              positive_int),
    FieldRule("num_experts", "implemented", "alias of num_local_experts (transformers' attribute_map)",
              ("mixtral", "qwen3_moe"), positive_int),
    FieldRule("num_experts_per_tok", "implemented", "top-k routing (float32 softmax, then top k)",
              ("mixtral", "qwen3_moe"), positive_int),
    FieldRule("moe_intermediate_size", "implemented", "SwiGLU width of one expert", ("qwen3_moe",)),
    FieldRule("norm_topk_prob", "implemented", "renormalise the top-k probabilities (mixtral: always)",
              ("qwen3_moe",)),
    FieldRule("decoder_sparse_step", "implemented", "layers i with (i + 1) % step != 0 run the dense MLP",
              ("qwen3_moe",), positive_int),
    FieldRule("mlp_only_layers", "implemented", "layers that run the dense MLP (intermediate_size wide)",
              ("qwen3_moe",)),
    *DEEPSEEK_V2_RULES,
    FieldRule("router_jitter_noise", "ignored", "transformers applies it only in training", ("mixtral",)),
    FieldRule("output_router_logits", "ignored", "router logits feed the training loss only; the tokens are the "
              "same", ("mixtral", "qwen3_moe")),
    FieldRule("router_aux_loss_coef", "ignored", "weight of the training load-balancing loss",
              ("mixtral", "qwen3_moe")),
    FieldRule("pretraining_tp", "ignored", "transformers 4 only slices the same matmuls; transformers 5 does not "
              "read it"),
    FieldRule("attention_dropout", "ignored", "dropout is off at inference"),
    FieldRule("resid_pdrop", "ignored", "dropout is off at inference", ("phi3",)),
    FieldRule("embd_pdrop", "ignored", "dropout is off at inference", ("phi3",)),
    FieldRule("initializer_range", "ignored", "weight init for training"),
    FieldRule("use_cache", "ignored", "the engine always caches KV"),
    FieldRule("pad_token_id", "ignored", "no padding: a step is a flat batch"),
    FieldRule("torch_dtype", "ignored", "--dtype chooses the dtype"),
    FieldRule("dtype", "ignored", "--dtype chooses the dtype"),
    FieldRule("auto_map", "ignored", "remote code is not run; transformers without trust_remote_code runs the "
              "model_type's class too"),
    *(FieldRule(key, "ignored", _METADATA) for key in (
        "model_type", "architectures", "transformers_version", "_name_or_path", "is_llama_config",
        "transformers.js_config", "output_attentions", "output_hidden_states", "return_dict")),
    # Gemma 3 (text): GEMMA3_HF_RULES below, appended (the last rule matching a field and model type wins).
)


def _gemma3_rope_problem(value: Any) -> Optional[str]:
    """What of Gemma 3's ``rope_parameters`` (flat, or per layer type) the engine does not compute, or ``None``."""
    if not isinstance(value, dict) or not any(isinstance(v, dict) for v in value.values()):
        return _rope_problem(value)
    unknown = set(value) - {"full_attention", "sliding_attention"}
    if unknown:
        return f"RoPE parameters for layer types {sorted(unknown)} are not implemented"
    local = value.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        return "RoPE scaling on the sliding (local) layers is not implemented (global layers: " \
            f"{', '.join(ROPE_TYPES)})"
    return _rope_problem({k: v for k, v in (value.get("full_attention") or {}).items() if k != "rope_theta"})


GELU_TANH = ("gelu_pytorch_tanh",)
#: Gemma 3 (text, ``Gemma3ForCausalLM``; :mod:`goodserve.models.gemma3`).
GEMMA3_HF_RULES: tuple[FieldRule, ...] = tuple(FieldRule(*rule[:2], rule[2], ("gemma3_text",), *rule[3:]) for rule in (
    ("hidden_activation", "implemented", "GeGLU with the tanh GELU", only(GELU_TANH, "only gelu_pytorch_tanh is "
                                                                                      "implemented")),
    ("hidden_act", "ignored", _NOT_READ),
    ("query_pre_attn_scalar", "implemented", "attention scores scaled by query_pre_attn_scalar ** -0.5"),
    ("sliding_window", "implemented", "local layers attend within W tokens (q - W < k <= q)",
     lambda v: positive_int(v) and "a window-less gemma3_text (local layers with their own RoPE over the whole "
     "context) is not implemented; expected a positive int"),
    ("layer_types", "implemented", "full_attention (global) / sliding_attention (local) per layer",
     _layer_types_problem),
    ("sliding_window_pattern", "implemented", "every n-th layer global (when layer_types is absent)"),
    ("_sliding_window_pattern", "ignored", "transformers writes it beside layer_types, which it reads instead"),
    ("rope_local_base_freq", "implemented", "RoPE base of the local layers"),
    ("rope_parameters", "implemented", "per layer type: full_attention (default, linear, llama3), sliding_attention "
     "(default)", _gemma3_rope_problem),
    ("rope_scaling", "implemented", "the global layers' scaling: " + ", ".join(ROPE_TYPES), _rope_problem),
    ("attention_bias", "refused", "attention biases are not implemented for gemma3_text",
     refuse_if_set("attention biases on a gemma3_text model are not implemented")),
    ("use_bidirectional_attention", "refused", "bidirectional attention is not implemented (causal only)",
     refuse_if_set("bidirectional attention is not implemented")),
))
HF_RULES = HF_RULES + GEMMA3_HF_RULES


def _scalar_problem(value: Any) -> Optional[str]:
    return "per-layer values (an array) are not implemented" if isinstance(value, list) else None


#: GGUF metadata keys under ``{arch}.`` for the ``llama``, ``qwen2``, ``qwen3``, ``phi3``, ``qwen3moe``, ``gemma3``
#: and ``deepseek2`` architectures (llama.cpp's names).
GGUF_RULES: tuple[FieldRule, ...] = (
    *(FieldRule(key, "implemented", "shape", problem=_scalar_problem) for key in (
        "context_length", "embedding_length", "feed_forward_length", "block_count", "attention.head_count",
        "attention.head_count_kv", "attention.key_length")),
    FieldRule("attention.value_length", "implemented", "equal to key_length", problem=_scalar_problem),
    FieldRule("attention.layer_norm_rms_epsilon", "implemented", "RMSNorm epsilon"),
    FieldRule("rope.freq_base", "implemented", "RoPE base"),
    FieldRule("rope.dimension_count", "implemented", "equal to the head width (partial rotary refused)"),
    FieldRule("rope.scaling.type", "implemented", "none, linear",
              problem=only(("none", "linear"), "only none and linear RoPE scaling are implemented")),
    FieldRule("rope.scaling.factor", "implemented", "linear scaling's factor"),
    FieldRule("rope.scaling.original_context_length", "ignored", "linear scaling does not read it (phi3 GGUFs always "
              "carry it; their LongRoPE, which reads it, comes as rope_factors tensors, refused)"),
    FieldRule("rope.scaling.finetuned", "ignored", _METADATA),
    FieldRule("rope.scaling.attn_factor", "refused", "YaRN's attention factor is not implemented",
              problem=not_one("only 1.0 is implemented")),
    FieldRule("attention.sliding_window", "capped", "attention within W tokens: exact up to W; 0 is no window (as "
              "llama.cpp writes for a phi3 without one)", problem=lambda v: None if v == 0 else _window_problem(v)),
    FieldRule("vocab_size", "ignored", "the token embedding's rows are the vocabulary"),
    *(FieldRule(key, "refused", f"{what} is not implemented", problem=refuse_if_set(f"{what} is not implemented"))
      for key, what in (("expert_count", "a mixture of experts"), ("expert_used_count", "a mixture of experts"),
                        ("attn_logit_softcapping", "attention logit soft-capping"),
                        ("final_logit_softcapping", "final logit soft-capping"),
                        ("logit_scale", "logit scaling"), ("embedding_scale", "embedding scaling"),
                        ("residual_scale", "residual scaling"), ("attention.scale", "a custom attention scale"),
                        ("attention.clamp_kqv", "q/k/v clamping"),
                        ("attention.layer_norm_epsilon", "LayerNorm in place of RMSNorm"))),
    FieldRule("expert_count", "implemented", "routed experts per layer", ("qwen3moe",), positive_int),
    FieldRule("expert_used_count", "implemented", "top-k routing, renormalised as llama.cpp does for qwen3moe",
              ("qwen3moe",), positive_int),
    FieldRule("expert_feed_forward_length", "implemented", "SwiGLU width of one expert", ("qwen3moe",)),
    FieldRule("feed_forward_length", "ignored", "no dense MLP: every qwen3moe layer is a mixture of experts",
              ("qwen3moe",)),
    # Gemma 3 text (goodserve.models.gguf_gemma3): llama.cpp fixes the layer layout, local RoPE base and score scale.
    FieldRule("attention.sliding_window", "implemented", "local layers (llama.cpp: all but every 6th) attend within "
              "W tokens; 0 or absent: every layer global", ("gemma3",),
              lambda v: None if v == 0 else _window_problem(v)),
    FieldRule("attention.sliding_window_pattern", "implemented", "only llama.cpp's gemma3 layout (every 6th layer "
              "global; older llama.cpp applies it whatever the key says)", ("gemma3",), swa_pattern_problem),
    FieldRule("rope.freq_base_swa", "implemented", "the local layers' RoPE base (absent: 10000, as older llama.cpp)",
              ("gemma3",)),
    FieldRule("rope.scaling.type", "implemented", "none, linear: on the global layers (llama.cpp's local layers take "
              "no scaling, as HF's)", ("gemma3",), only(("none", "linear"), "only none and linear RoPE scaling are "
                                                                              "implemented")),
    *DEEPSEEK2_GGUF_RULES,  # DeepSeek-V2's MLA and DeepSeekMoE keys (models/gguf_deepseek2.py)
)

#: GGUF tensors (or name parts) that ask for math the engine lacks, with the reason given when refusing them.
GGUF_TENSOR_REASONS = (
    ("rope_freqs.weight", "per-dimension RoPE frequency factors (Llama 3.1+ scaling as llama.cpp stores it) are "
                          "not implemented"),
    ("rope_factors_", "LongRoPE's per-dimension factors (Phi-3 128k, Phi-3.5) are not implemented"),
    ("_exps.", "a mixture of experts is not implemented"),
    ("ffn_gate_inp.", "a mixture of experts is not implemented"),
    ("_norm.", "an extra normalisation (e.g. q/k norm) is not implemented"),
    (".bias", "this bias is not implemented"),
)


def _rules_for(rules: Iterable[FieldRule], model_type: str) -> dict[str, FieldRule]:
    return {rule.field: rule for rule in rules if not rule.model_types or model_type in rule.model_types}


def check_hf_config(cfg: dict[str, Any], model_type: str) -> None:
    """Refuse a HF config asking for what the engine does not compute; log keys no rule covers.

    Args:
        cfg: The ``config.json`` contents.
        model_type: Its ``model_type``, one the loader supports.

    Raises:
        ValueError: naming the first refused field, its value and what is supported.
    """
    rules = _rules_for(HF_RULES, model_type)
    for key, value in cfg.items():
        rule = rules.get(key)
        problem = rule.problem(value) if rule is not None and rule.problem is not None else None
        if problem:
            raise ValueError(f"config.json {key}={value!r} is not supported: {problem}")
    unknown = sorted(key for key in cfg if key not in rules)
    if unknown:
        logger.warning("config.json keys the engine does not know (their effect, if any, is not implemented): %s",
                       ", ".join(unknown))


def check_gguf_metadata(arch: str, fields: dict[str, Any]) -> None:
    """Refuse GGUF metadata under ``{arch}.`` that no rule accepts (unknown keys included).

    Args:
        arch: ``general.architecture``, one the loader supports.
        fields: All metadata key -> value.

    Raises:
        ValueError: naming the first refused key and its value.
    """
    rules = _rules_for(GGUF_RULES, arch)
    prefix = f"{arch}."
    for key, value in fields.items():
        if not key.startswith(prefix):
            continue
        rule = rules.get(key[len(prefix):])
        if rule is None:
            raise ValueError(f"GGUF metadata {key}={value!r} is not supported: the engine does not implement it")
        problem = rule.problem(value) if rule.problem is not None else None
        if problem:
            raise ValueError(f"GGUF metadata {key}={value!r} is not supported: {problem}")
    splits = fields.get("split.count", 1)
    if splits and int(splits) > 1:
        raise ValueError(f"GGUF metadata split.count={splits} is not supported: merge the split files into one")


def check_gguf_tensors(names: Iterable[str], expected: set[str]) -> None:
    """Refuse a GGUF holding tensors the engine would not use (each is math it would skip).

    Args:
        names: The file's tensor names.
        expected: The names the engine reads for this config.

    Raises:
        ValueError: naming the first unexpected tensor and, where known, what it is for.
    """
    for name in names:
        if name in expected:
            continue
        reason = next((why for part, why in GGUF_TENSOR_REASONS if part in name),
                      "the engine has no use for it, and skipping it could change the output")
        raise ValueError(f"GGUF tensor {name!r} is not supported: {reason}")


def exact_context_len(model: ModelConfig) -> Optional[int]:
    """The longest sequence, in tokens, whose output the engine computes exactly; ``None``: no limit here.

    A layer with a window of ``W`` tokens attends to the token itself and the ``W - 1`` before it, as transformers
    does (``tests/test_sliding_window.py``), when ``layer_types`` says which layers slide (every HF config with a
    window). Without ``layer_types`` (a GGUF's ``attention.sliding_window``) the window is applied to every layer
    but not checked against llama.cpp: the output is claimed exact only up to ``W`` tokens, where windowed and
    full attention agree.
    """
    return model.sliding_window if not model.layer_types else None


def resolve_max_model_len(requested: Optional[int], model: ModelConfig) -> int:
    """``max_model_len`` within the model's positions and what :func:`exact_context_len` allows.

    Args:
        requested: ``--max-model-len`` as the user gave it; ``None`` takes the model's context length.
        model: The architecture.

    Returns:
        ``min(requested or max_position_embeddings, max_position_embeddings)``, capped to the exact length
        (with a WARNING) when the user did not ask for a length.

    Raises:
        ValueError: if the user asked for more tokens than the engine computes exactly.
    """
    limit = model.max_position_embeddings
    length = min(requested or limit, limit)
    exact = exact_context_len(model)
    if exact is None or length <= exact:
        return length
    if requested is not None:
        raise ValueError(f"max_model_len={requested} is longer than the model's sliding_window={exact}: the engine "
                         f"is exact only up to sliding_window tokens for a GGUF's window; ask for at most {exact}")
    logger.warning("sliding_window=%d is shorter than the model's %d positions: capping max_model_len to %d "
                   "(full attention equals windowed attention within the window)", exact, limit, exact)
    return exact
