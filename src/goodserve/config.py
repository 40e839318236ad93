"""Frozen configuration dataclasses for the engine.

Every config is immutable once built: a component receives the config it needs as an argument and never
reads global state. ``ModelConfig`` (:mod:`goodserve.model_config`) describes the architecture (read from a
HF ``config.json`` by :meth:`ModelConfig.from_hf_config`, the one parser the loader and the simulator's
presets share, or from GGUF metadata by :mod:`goodserve.models.loader`); ``CacheConfig`` sizes the paged KV pool;
``SchedulerConfig`` sets the per-step limits; ``EngineConfig`` groups them. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from goodserve.kv_cache.layout import KVCacheLayout
from goodserve.kv_events.config import KVEventsConfig
from goodserve.kv_transfer.config import KVTransferConfig
from goodserve.kv_transfer.params import KVTransferParams
from goodserve.model_config import ModelConfig
from goodserve.request_options import UNSET, RequestOptions
from goodserve.spec.config import SpeculativeConfig

SCHEDULING_POLICIES = ("fcfs", "priority", "slo")
# How batches form: "chunked" is continuous batching with chunked prefill (Sarathi-Serve); "static" is
# request-level batching, where a batch runs to completion before the next is admitted (pre-Orca);
# "reserve" is continuous batching that reserves KV for prompt + max_tokens at admission (Orca's memory
# policy, never preempts); "prefill-first" is unchunked continuous batching that runs admitted prompts
# before decodes (vLLM v0). Every mode runs over the paged KV cache.
SCHEDULING_MODES = ("chunked", "static", "reserve", "prefill-first")

#: ``--attention-backend`` values (``goodserve.models.attention.make_attention_backend``): ``auto`` (the native
#: CPU kernel that reads the paged KV cache in place, where it builds; else ``torch``), ``torch`` (portable
#: PyTorch, any device), ``native`` (the CPU kernel; an error where it cannot run).
ATTENTION_BACKENDS = ("auto", "torch", "native")

#: ``--quantization`` values (``goodserve.models.quant.make_linear``): ``auto`` runs a GGUF's Q4_0/Q4_1/Q8_0
#: and Q4_K/Q5_K/Q6_K blocks as the file holds them when the dtype is bfloat16, on goodserve's block kernel
#: (AVX-512 VNNI or AVX2, int16 activations; also in float32 under ``--dtype auto`` on an AVX2-only CPU) or else
#: PyTorch's int4 CPU kernel for Q4_0/Q4_1 (the K-quants: dense), and everything else in the dtype; ``none``
#: dequantizes every weight to the dtype; ``int4`` / ``int8`` run every linear layer on that kernel,
#: re-quantizing weights the file does not hold that way.
QUANTIZATIONS = ("auto", "none", "int8", "int4")

#: ``--kv-cache-dtype`` values: ``auto`` (the activation ``--dtype``), ``bfloat16``, ``float32``, or ``int8``
#: (symmetric absmax quantisation per token and KV head, one float32 scale per row: the cache layout of
#: :mod:`goodserve.models.kv_quant`). No fp8: see :func:`goodserve.engine.args.resolve_kv_cache_dtype`.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")

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
        layout: How the model's layers lie over the pool: its KV-cache groups, each with its own block tables
            (:mod:`goodserve.kv_cache.layout`; a sliding group frees the blocks before its window as requests
            advance). ``None``: one full-attention group of every layer.
    """

    num_blocks: int = field(metadata=_flag("--num-blocks", "KV pool size in blocks (default: sized from the memory "
                                                          "the KV cache may take)", default=None))
    block_size: int = field(default=16, metadata=_flag("--block-size", "tokens per KV block"))
    enable_prefix_caching: bool = field(default=True, metadata=_flag(
        "--no-prefix-caching", "do not reuse the KV blocks of shared prompt prefixes"))
    enable_kv_events: bool = False
    layout: Optional[KVCacheLayout] = None

    @property
    def group_windows(self) -> tuple[Optional[int], ...]:
        """Per KV-cache group its window, or ``None`` (full attention)."""
        return self.layout.group_windows if self.layout is not None else (None,)

    @property
    def hybrid(self) -> bool:
        """Whether the pool holds several KV-cache groups (a block holds one group's layers)."""
        return len(self.group_windows) > 1

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
        fused_decode_step: Decode steps (rows verifying drafts included; in batch-invariant mode every step of
            up to :data:`~goodserve.models.native_decode.INVARIANT_DECODE_MAX_ROWS` tokens) of a model with a
            decode plan run every layer in one native call
            (``LlamaForCausalLM.decode_in_one_call``; the same bits as the layer-by-layer path).
        kv_cache_dtype: The dtype of the cached K/V: one of :data:`KV_CACHE_DTYPES`, ``auto`` being ``dtype``
            (:attr:`kv_dtype` resolves it).
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
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    log_stats_interval: float = 10.0
    kv_transfer: Optional[KVTransferConfig] = None
    slo_ttft: Optional[float] = None
    slo_tpot: Optional[float] = None
    speculative: Optional[SpeculativeConfig] = None
    kv_events: Optional[KVEventsConfig] = None

    @property
    def kv_dtype(self) -> str:
        """The cached K/V's dtype, resolved: ``"float32"``, ``"bfloat16"`` or ``"int8"``."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

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
