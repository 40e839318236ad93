"""The model's shapes as the engine reads them: :class:`ModelConfig` and its parsing of a HF ``config.json``.

Torch-free (the simulator and planner read any decoder's shapes here). Which architectures the engine can
run is the loader's question (:mod:`goodserve.models.hf_dir`, :mod:`goodserve.models.config_support`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from goodserve.config_deepseek import hf_deepseek_fields
from goodserve.config_layers import hf_layer_types, hf_rope_per_layer_type
from goodserve.kv_cache.layout import KVCacheLayout, plan_layout, uniform_layout
from goodserve.kv_cache.spec import KVCacheSpec, mla_spec

#: HF ``architectures`` class names -> ``model_type``, for a ``config.json`` that names only the class.
HF_CLASS_TO_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Gemma3ForCausalLM": "gemma3_text",
}
#: transformers' defaults, for keys a ``config.json`` leaves out, where a model type's config class differs from
#: ``LlamaConfig`` (the defaults :meth:`ModelConfig.from_hf_config` otherwise takes).
HF_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 128, "num_key_value_heads": 32, "max_position_embeddings": 32768},
    "phi3": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "mixtral": {"rope_theta": 1000000.0, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_key_value_heads": 4, "max_position_embeddings": 32768, "num_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False},
    **{kind: {"num_key_value_heads": 32, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
              "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
              "moe_intermediate_size": 1407, "norm_topk_prob": False} for kind in ("deepseek_v2", "deepseek_v3")},
    "gemma3_text": {"head_dim": 256, "num_key_value_heads": 4, "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "bos_token_id": 2, "eos_token_id": 1},
}
#: HF ``model_type`` values whose attention is multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, §2.1).
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
#: Keys of a HF ``config.json`` that :meth:`ModelConfig.from_hf_config` cannot do without.
HF_REQUIRED_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Phi-3, SmolLM2; the
    Mixtral and Qwen3-MoE mixtures of experts), of DeepSeek-V2 with multi-head latent attention (MLA) or of
    Gemma 3 (text).

    Attributes:
        architecture: Family name, e.g. ``"llama"`` or ``"qwen2"``.
        vocab_size: Number of token ids.
        hidden_size: Width of the residual stream.
        intermediate_size: Width of the SwiGLU MLP.
        num_hidden_layers: Number of decoder layers ``L``.
        num_attention_heads: Query heads.
        num_key_value_heads: KV heads ``n_kv`` (GQA/MQA when smaller than the query heads).
        head_dim: Per-head width ``d_head``.
        max_position_embeddings: The model's context length in tokens.
        rms_norm_eps: Epsilon of RMSNorm.
        rope_theta: RoPE base frequency.
        rope_scaling: HF-style rope scaling dict (``rope_type`` ``"llama3"`` is supported; ``"yarn"`` for MLA) or
            ``None``.
        attention_bias: Whether q/k/v projections carry a bias (Qwen2).
        tie_word_embeddings: Whether the LM head shares the embedding matrix.
        sliding_window: Attention window ``W`` in tokens that at least one layer of the checkpoint applies (a
            token attends to itself and the ``W - 1`` before it, as HF masks ``kv_idx > q_idx - W``; Mistral 7B
            paper §2), or ``None`` for full attention everywhere. Which layers apply it: ``layer_types``.
        layer_types: ``"full_attention"`` / ``"sliding_attention"`` per layer, as HF's ``layer_types`` (parsed from
            a HF config whenever ``sliding_window`` is set); empty: every layer applies ``sliding_window`` (a GGUF's
            ``attention.sliding_window``, whose placement :mod:`goodserve.models.config_support` does not trust
            past the window, so it caps ``max_model_len`` there).
        rope_local_theta: RoPE base of the sliding layers when it differs from ``rope_theta`` (Gemma 3's
            ``rope_local_base_freq``; those layers take no rope scaling), else ``None``.
        query_pre_attn_scalar: Attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` instead of
            ``head_dim ** -0.5`` (Gemma 3), or ``None``.
        bos_token_id: Beginning-of-sequence token id, if any.
        eos_token_ids: Token ids that end generation (EOS and e.g. ``<|eot_id|>``).
        qk_norm: Whether each head of q and of k is RMS-normalised over ``head_dim`` before RoPE, with a
            ``[head_dim]`` weight per projection (Qwen3's ``q_norm`` / ``k_norm``).
        num_experts: Routed experts of each mixture-of-experts MLP ``E``; ``0`` for a dense model.
        num_experts_per_tok: Experts each token is routed to (top-k).
        moe_intermediate_size: SwiGLU width of one expert.
        norm_topk_prob: Whether the top-k routing probabilities are renormalised to sum to 1 (Mixtral always;
            Qwen3-MoE's ``norm_topk_prob``).
        dense_mlp_layers: Layers of a mixture-of-experts model whose MLP is the dense SwiGLU of width
            ``intermediate_size`` (Qwen3-MoE's ``mlp_only_layers`` and those ``decoder_sparse_step`` skips).
        kv_lora_rank: MLA only (``None`` otherwise): width ``d_c`` of the compressed KV latent ``c_KV`` each
            layer caches per token (DeepSeek-V2 §2.1.2); K and V are re-projected from it by ``kv_b_proj``.
        q_lora_rank: MLA: width ``d_c'`` of the compressed query (``q_a_proj`` / ``q_b_proj``), or ``None`` for a
            full-rank ``q_proj``.
        qk_nope_head_dim: MLA: per-head width ``d_h`` of the query/key part without RoPE.
        qk_rope_head_dim: MLA: width ``d_h^R`` of the decoupled RoPE part of each query head and of the one
            RoPE key shared by all heads (§2.1.3); cached beside ``c_KV``.
        v_head_dim: MLA: per-head value width. For MLA ``head_dim`` is ``qk_nope_head_dim + qk_rope_head_dim``.
        num_shared_experts: DeepSeekMoE: always-on experts, one SwiGLU of ``num_shared_experts *
            moe_intermediate_size`` added to the routed experts' output (DeepSeek-V2 §2.2.1).
        routed_scaling_factor: DeepSeekMoE: factor on the routed experts' softmax weights.
        expert_groups: DeepSeekMoE ``(n_group, topk_group)``: experts are routed only within the ``topk_group``
            groups of highest best score (``group_limited_greedy``, §2.2.2); ``(1, 1)``: no grouping.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = field(default=None, compare=False, hash=False)
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: Optional[int] = None
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_mlp_layers: tuple[int, ...] = ()
    kv_lora_rank: Optional[int] = None
    q_lora_rank: Optional[int] = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    expert_groups: tuple[int, int] = (1, 1)

    @property
    def is_mla(self) -> bool:
        """Whether attention is MLA: one latent row per layer and token is cached, not per-head K and V."""
        return self.kv_lora_rank is not None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: Optional[float] = None
    query_pre_attn_scalar: Optional[float] = None

    def layer_window(self, layer: int) -> Optional[int]:
        """The window (tokens) layer ``layer`` attends within, or ``None`` for full causal attention."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts (else the dense SwiGLU)."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    def kv_cache_layout(self, hybrid: bool = True) -> KVCacheLayout:
        """How the engine lays the model's layers over the KV pool (:mod:`goodserve.kv_cache.layout`).

        Args:
            hybrid: Give a model mixing local and global layers (Gemma 3, Qwen2 with ``max_window_layers``) one
                group per kind and size, whose local groups free the blocks before their window. ``False``: one
                ``full`` group of every layer (the local layers mask to their window but keep every block), for
                what does not handle several groups (a draft model's shared blocks, KV transfer, the one-call
                decode step).

        Returns:
            One group of every layer when every layer attends the same way (MLA included), else as ``hybrid`` says.
        """
        windows = [self.layer_window(i) for i in range(self.num_hidden_layers)]
        if len(set(windows)) > 1 and not hybrid:
            return uniform_layout(self.num_hidden_layers)
        return plan_layout(windows)

    def kv_cache_spec(self, kv_dtype: str, hybrid: bool = True) -> KVCacheSpec:
        """The model's KV-cache groups with every element in ``kv_dtype`` (a key of
        :data:`~goodserve.kv_cache.spec.KV_DTYPE_BYTES`), as :meth:`kv_cache_layout` ``(hybrid)`` lays them out:
        what a token costs, :mod:`goodserve.kv_cache.spec`.

        Raises:
            ValueError: an unknown ``kv_dtype``.
        """
        if self.is_mla:
            return mla_spec(self.num_hidden_layers, self.kv_lora_rank, self.qk_rope_head_dim, kv_dtype)
        return self.kv_cache_layout(hybrid).spec(kv_dtype, self.num_key_value_heads, self.head_dim)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], generation_cfg: Optional[dict[str, Any]] = None) -> "ModelConfig":
        """Read a parsed HF ``config.json`` (transformers 4 or 5 layout).

        This parses only; whether the engine can run the architecture is the loader's question, so the
        simulator can read any decoder's shapes here too. Defaults for keys a config may leave out:
        ``num_key_value_heads = num_attention_heads``, ``head_dim = hidden_size // num_attention_heads``,
        ``max_position_embeddings = 2048`` and ``rms_norm_eps = 1e-6`` (transformers' ``LlamaConfig``
        defaults; :data:`HF_TYPE_DEFAULTS` where the model type's class has others), ``rope_theta = 10000``
        without scaling, untied embeddings. ``attention_bias`` is always
        on for a Qwen2-family ``model_type`` (their q/k/v projections always carry a bias), always off for
        ``mistral`` (transformers' Mistral has no biases and ignores the key), else the config's
        ``attention_bias`` (default off). ``qk_norm`` is on for a Qwen3-family ``model_type``.
        For an MLA ``model_type`` (:data:`MLA_MODEL_TYPES`) the latent widths are read and ``head_dim`` is
        ``qk_nope_head_dim + qk_rope_head_dim`` (transformers' own ``head_dim`` there is the RoPE width).
        ``sliding_window`` is the window transformers applies and ``layer_types`` the layers it applies to
        (:func:`goodserve.config_layers.hf_layer_types`); Gemma 3's per-layer-type RoPE gives ``rope_local_theta``.

        Args:
            cfg: The ``config.json`` contents.
            generation_cfg: The ``generation_config.json`` contents, if any; its EOS ids are merged in.

        Returns:
            The model config; ``architecture`` is the ``model_type`` (from the class name in
            ``architectures`` when the key is absent; ``""`` when neither says).

        Raises:
            ValueError: If a key of :data:`HF_REQUIRED_KEYS` is missing.
        """
        missing = [key for key in HF_REQUIRED_KEYS if key not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {missing[0]!r}")
        model_type = hf_model_type(cfg) or ""
        cfg = {**HF_TYPE_DEFAULTS.get(model_type, {}), **cfg}
        local_theta = None
        if model_type == "gemma3_text":
            cfg, local_theta = hf_rope_per_layer_type(cfg)
        layer_types = hf_layer_types(cfg, model_type)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        theta, scaling = _hf_rope(cfg)
        eos = token_id_list(cfg.get("eos_token_id"))
        if generation_cfg:
            eos += token_id_list(generation_cfg.get("eos_token_id"))
        bos = cfg.get("bos_token_id")
        num_layers = int(cfg["num_hidden_layers"])
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense_layers = tuple(i for i in range(num_layers) if experts and model_type == "qwen3_moe" and (
            i in (cfg.get("mlp_only_layers") or ()) or (i + 1) % step != 0))
        mla: dict[str, Any] = {}
        if model_type in MLA_MODEL_TYPES:  # latent attention and DeepSeekMoE
            mla, experts, dense_layers = hf_deepseek_fields(cfg)
            cfg = {**cfg, "head_dim": mla.pop("head_dim")}
        return cls(
            architecture=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=model_type.startswith("qwen2")
            or (model_type != "mistral" and bool(cfg.get("attention_bias", False))),
            qk_norm=model_type.startswith("qwen3"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=unique_ids(eos),
            sliding_window=int(cfg["sliding_window"]) if layer_types else None,
            layer_types=layer_types,
            rope_local_theta=local_theta,
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if model_type == "gemma3_text" else None,
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
            norm_topk_prob=model_type == "mixtral" or bool(cfg.get("norm_topk_prob", True)),
            dense_mlp_layers=dense_layers,
            **mla,
        )


def hf_model_type(cfg: dict[str, Any]) -> Optional[str]:
    """A HF config's ``model_type``, or the one its ``architectures`` class names imply, or ``None``."""
    model_type = cfg.get("model_type")
    if model_type is None:
        for class_name in cfg.get("architectures") or []:
            if class_name in HF_CLASS_TO_MODEL_TYPE:
                return HF_CLASS_TO_MODEL_TYPE[class_name]
    return model_type


def hf_sliding_window(cfg: dict[str, Any]) -> Optional[int]:
    """The attention window transformers applies to a HF config, in tokens, or ``None`` (full attention): ``W``
    when at least one layer attends within ``W`` tokens (which ones: :func:`goodserve.config_layers.hf_layer_types`).

    Args:
        cfg: The ``config.json`` contents.
    """
    model_type = hf_model_type(cfg) or ""
    cfg = {**HF_TYPE_DEFAULTS.get(model_type, {}), **cfg}
    return int(cfg["sliding_window"]) if hf_layer_types(cfg, model_type) else None


def token_id_list(value: Any) -> list[int]:
    """A config's token id field (absent, one id, or a list of ids) as a list of ints."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def unique_ids(ids: list[int]) -> tuple[int, ...]:
    """``ids`` without repeats, first occurrences in order."""
    return tuple(dict.fromkeys(ids))


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """RoPE base and scaling dict from either the transformers-4 or the transformers-5 config layout.

    ``rope_scaling`` wins over ``rope_parameters`` as in transformers; for ``llama3`` and ``yarn`` (DeepSeek-V2)
    scaling the pretraining length is the dict's ``original_max_position_embeddings``, else
    ``max_position_embeddings`` (transformers' ``standardize_rope_params``; a top-level key of that name does not
    reach Llama's or DeepSeek-V2's RoPE).
    """
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None:
            scaling = params
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        if "rope_type" not in scaling and "type" in scaling:
            scaling["rope_type"] = scaling["type"]
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        elif scaling["rope_type"] in ("llama3", "yarn"):
            scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings") or 2048)
    return float(theta if theta is not None else 10000.0), scaling
