"""Frozen configuration dataclasses for the engine.

Every config is immutable once built: a component receives the config it needs as an argument and never
reads global state. ``ModelConfig`` describes the architecture (read from a HF ``config.json`` by
:meth:`ModelConfig.from_hf_config`, the one parser the loader and the simulator's presets share, or from
GGUF metadata by :mod:`goodserve.models.loader`); ``CacheConfig`` sizes the paged KV pool;
``SchedulerConfig`` sets the per-step limits; ``EngineConfig`` groups them. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from goodserve.config_layers import hf_layer_types, hf_rope_per_layer_type
from goodserve.kv_cache.spec import KVCacheGroup, KVCacheSpec, dense_spec
from goodserve.kv_events.config import KVEventsConfig
from goodserve.kv_transfer.config import KVTransferConfig
from goodserve.kv_transfer.params import KVTransferParams
from goodserve.request_options import UNSET, RequestOptions
from goodserve.spec.config import SpeculativeConfig

SCHEDULING_POLICIES = ("fcfs", "priority", "slo")
# How batches form: "chunked" is continuous batching with chunked prefill (Sarathi-Serve); "static" is
# request-level batching, where a batch runs to completion before the next is admitted (pre-Orca);
# "reserve" is continuous batching that reserves KV for prompt + max_tokens at admission (Orca's memory
# policy, never preempts); "prefill-first" is unchunked continuous batching that runs admitted prompts
# before decodes (vLLM v0). Every mode runs over the paged KV cache.
SCHEDULING_MODES = ("chunked", "static", "reserve", "prefill-first")

#: HF ``architectures`` class names -> ``model_type``, for a ``config.json`` that names only the class.
HF_CLASS_TO_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
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
    "gemma3_text": {"head_dim": 256, "num_key_value_heads": 4, "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "bos_token_id": 2, "eos_token_id": 1},
}
#: Keys of a HF ``config.json`` that :meth:`ModelConfig.from_hf_config` cannot do without.
HF_REQUIRED_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")


#: ``--attention-backend`` values (``goodserve.models.attention.make_attention_backend``): ``auto`` (the native
#: CPU kernel that reads the paged KV cache in place, where it builds; else ``torch``), ``torch`` (portable
#: PyTorch, any device), ``native`` (the CPU kernel; an error where it cannot run).
ATTENTION_BACKENDS = ("auto", "torch", "native")

#: ``--quantization`` values (``goodserve.models.quant.make_linear``): ``auto`` runs a GGUF's Q4_0/Q4_1/Q8_0
#: blocks as the file holds them when the dtype is bfloat16, on goodserve's block kernel (AVX-512 VNNI, int16
#: activations) or else PyTorch's int4 CPU kernel for Q4, and everything else in the dtype; ``none``
#: dequantizes every weight to the dtype; ``int4`` / ``int8`` run every linear layer on that kernel,
#: re-quantizing weights the file does not hold that way.
QUANTIZATIONS = ("auto", "none", "int8", "int4")

@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Phi-3, SmolLM2; the
    Mixtral and Qwen3-MoE mixtures of experts) or of Gemma 3 (text).

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
        rope_scaling: HF-style rope scaling dict (``rope_type`` ``"llama3"`` is supported) or ``None``.
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

    def kv_cache_spec(self, kv_dtype: str) -> KVCacheSpec:
        """The model's KV-cache groups with every element in ``kv_dtype`` (a key of
        :data:`~goodserve.kv_cache.spec.KV_DTYPE_BYTES`): what a token costs, :mod:`goodserve.kv_cache.spec`.

        Groups are those the engine runs: one ``sliding`` group when every layer attends within the same window
        (its blocks before the window are freed as a request advances, :mod:`goodserve.kv_cache.sliding`); else
        one ``full`` group of every layer, also for a model mixing local and global layers (Gemma 3): their
        local layers mask to the window but keep every block, saving no memory.

        Raises:
            ValueError: an unknown ``kv_dtype``.
        """
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        if len(windows) == 1 and None not in windows:
            return KVCacheSpec(kv_dtype, (KVCacheGroup("sliding", self.num_hidden_layers, self.num_key_value_heads,
                                                       self.head_dim, self.sliding_window),))
        return dense_spec(self.num_hidden_layers, self.num_key_value_heads, self.head_dim, kv_dtype)

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

    ``rope_scaling`` wins over ``rope_parameters`` as in transformers; for ``llama3`` scaling the
    pretraining length is the dict's ``original_max_position_embeddings``, else ``max_position_embeddings``
    (transformers' ``standardize_rope_params``; a top-level key of that name does not reach Llama's RoPE).
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
        elif scaling["rope_type"] == "llama3":
            scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings") or 2048)
    return float(theta if theta is not None else 10000.0), scaling


def _flag(flag: str, help: str, dest: Optional[str] = None, choices: Optional[tuple] = None,
          **default: Any) -> dict[str, Any]:
    """A config field's command-line flag, read by :mod:`goodserve.config_flags` (``dest`` defaults to the
    field's name; ``default``, if given, replaces the field's on the command line: ``None`` for a value the
    engine resolves itself)."""
    return {"flag": flag, "help": help, "dest": dest, "choices": choices, **({"cli_default": default["default"]}
                                                                          if "default" in default else {})}


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache, resolved (the engine sizes the pool from ``EngineArgs`` first).

    Attributes:
        num_blocks: Blocks in the pool.
        block_size: Tokens per KV block.
        enable_prefix_caching: Register full blocks by content hash and reuse them across requests.
        enable_kv_events: Record the prefix cache's changes as KV events (:mod:`goodserve.kv_events`; set by
            ``--kv-events-config``, and by the simulator for ``kv-aware`` routing).
        sliding_window: The window of the model's one ``sliding`` KV-cache group (every layer attends within it,
            :meth:`ModelConfig.kv_cache_spec`): blocks before it are freed as requests advance; ``None``: none.
    """

    num_blocks: int = field(metadata=_flag("--num-blocks", "KV pool size in blocks (default: sized from the memory "
                                                          "the KV cache may take)", default=None))
    block_size: int = field(default=16, metadata=_flag("--block-size", "tokens per KV block"))
    enable_prefix_caching: bool = field(default=True, metadata=_flag(
        "--no-prefix-caching", "do not reuse the KV blocks of shared prompt prefixes"))
    enable_kv_events: bool = False
    sliding_window: Optional[int] = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of the iteration-level scheduler.

    Attributes:
        max_num_batched_tokens: Token budget of one step (prefill chunks + decodes), Sarathi-Serve §4.
        max_num_seqs: Most requests in the running batch.
        max_model_len: Longest sequence (prompt + output) in tokens a request may reach.
        policy: ``"fcfs"`` (arrival order), ``"priority"`` (lower value first, then arrival) or ``"slo"``
            (goodput first, :mod:`goodserve.scheduler.slo`; ``chunked`` mode only).
        mode: How batches form, one of ``SCHEDULING_MODES``.
        shed_load: Under ``slo``, refuse a request whose TTFT SLO can no longer be met instead of serving it
            late.
    """

    max_num_batched_tokens: int = field(default=1024, metadata=_flag("--max-num-batched-tokens",
                                                                     "token budget per step"))
    max_num_seqs: int = field(default=128, metadata=_flag("--max-num-seqs", "most running requests"))
    max_model_len: int = field(default=8192, metadata=_flag(
        "--max-model-len", "longest prompt + output in tokens (default: the model's context length)", default=None))
    policy: str = field(default="fcfs", metadata=_flag(
        "--scheduling-policy", "waiting order: fcfs, priority, or slo (goodput first: order, step size, admission "
        "and preemption from predicted step times and each request's SLOs)", dest="scheduling_policy",
        choices=SCHEDULING_POLICIES))
    mode: str = field(default="chunked", metadata=_flag(
        "--scheduler", "batching mode: chunked (default: continuous, chunked prefill); baselines: static "
        "(request-level), reserve (reserve max length), prefill-first (vLLM v0: unchunked, prompts before "
        "decodes)", dest="scheduler", choices=SCHEDULING_MODES))
    shed_load: bool = field(default=False, metadata=_flag(
        "--shed-load", "with --scheduling-policy slo: refuse (429) requests whose TTFT SLO can no longer be met"))

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if self.mode not in SCHEDULING_MODES:
            raise ValueError(f"mode must be one of {SCHEDULING_MODES}, got {self.mode!r}")
        if self.policy == "slo" and self.mode != "chunked":
            raise ValueError(f"policy 'slo' needs scheduler mode 'chunked', got {self.mode!r}")
        if self.shed_load and self.policy != "slo":
            raise ValueError("shed_load needs policy 'slo' (it sheds by predicted TTFT)")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs, resolved.

    Attributes:
        model_path: Path of the GGUF file or HF model directory.
        model: The architecture.
        cache: The KV pool.
        scheduler: Step limits (``max_model_len`` resolved).
        dtype: ``"float32"`` or ``"bfloat16"``.
        quantization: How linear layers run: ``"auto"``, ``"none"``, ``"int8"`` or ``"int4"`` (see
            ``goodserve.models.quant``).
        attention_backend: One of :data:`ATTENTION_BACKENDS`.
        batch_invariant: Every kernel a token passes through reduces in an order that does not depend on its
            batch (``goodserve.models.invariant``): a request's tokens depend on its prompt and seed alone.
        fused_decode_step: Decode-only steps of a model with a decode plan run every layer in one native call
            (``LlamaForCausalLM.decode_in_one_call``; the same bits as the layer-by-layer path).
        device: ``"cpu"`` or ``"cuda"``.
        seed: Seed of the engine-wide generator used by unseeded sampled requests.
        log_stats_interval: Seconds between periodic stats log lines (``0`` disables them).
        kv_transfer: The instance's part in disaggregated serving (``None``: none).
        slo_ttft: A request's TTFT SLO in seconds when it gives none (``None``: none).
        slo_tpot: A request's TPOT SLO in seconds when it gives none (``None``: none).
        speculative: Speculative decoding (``None``: none; :class:`goodserve.spec.config.SpeculativeConfig`).
        kv_events: Where the prefix cache's KV events are published (``None``: nowhere).
    """

    model_path: str
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    dtype: str = "bfloat16"
    quantization: str = "none"
    attention_backend: str = "auto"
    batch_invariant: bool = False
    fused_decode_step: bool = True
    device: str = "cpu"
    seed: int = 0
    log_stats_interval: float = 10.0
    kv_transfer: Optional[KVTransferConfig] = None
    slo_ttft: Optional[float] = None
    slo_tpot: Optional[float] = None
    speculative: Optional[SpeculativeConfig] = None
    kv_events: Optional[KVEventsConfig] = None

    def request_options(self, priority: int = 0, cache_salt: Optional[str] = None, slo_ttft: Any = UNSET,
                        slo_tpot: Any = UNSET, slo_class: Optional[str] = None,
                        kv_transfer_params: Any = None) -> RequestOptions:
        """A request's :class:`RequestOptions`, built where it enters, with this engine's defaults applied
        (the one place they are read).

        Args:
            priority: Lower runs first under the ``priority`` policy.
            cache_salt: Prefix-cache isolation key.
            slo_ttft: TTFT SLO in seconds; ``None``: no limit; :data:`UNSET`: this engine's ``slo_ttft``.
            slo_tpot: TPOT SLO in seconds, the same way.
            slo_class: The label of its SLOs on ``/metrics``; by default ``"default"`` when both SLOs are the
                engine's, else ``"custom"``.
            kv_transfer_params: Its part in disaggregated serving, as a request body gives it (a dict) or
                parsed.

        Raises:
            ParamError: on a malformed field (naming it).
        """
        if slo_class is None:
            slo_class = "default" if slo_ttft is UNSET and slo_tpot is UNSET else "custom"
        if isinstance(kv_transfer_params, dict):
            kv_transfer_params = KVTransferParams.from_dict(kv_transfer_params)
        return RequestOptions(priority, cache_salt, self.slo_ttft if slo_ttft is UNSET else slo_ttft,
                              self.slo_tpot if slo_tpot is UNSET else slo_tpot, slo_class, kv_transfer_params)
