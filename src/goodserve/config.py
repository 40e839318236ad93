"""Frozen configuration dataclasses for the engine.

Every config is immutable once built: a component receives the config it needs as an argument and never
reads global state. ``ModelConfig`` describes the architecture (read from a HF ``config.json`` or from
GGUF metadata by :mod:`goodserve.models.loader`); ``CacheConfig`` sizes the paged KV pool;
``SchedulerConfig`` sets the per-step limits; ``EngineConfig`` groups them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

SCHEDULING_POLICIES = ("fcfs", "priority")
# How batches form: "chunked" is continuous batching with chunked prefill (Sarathi-Serve); "static" is
# request-level batching, where a batch runs to completion before the next is admitted (pre-Orca);
# "reserve" is continuous batching that reserves KV for prompt + max_tokens at admission (Orca's memory
# policy, never preempts); "prefill-first" is unchunked continuous batching that runs admitted prompts
# before decodes (vLLM v0). Every mode runs over the paged KV cache.
SCHEDULING_MODES = ("chunked", "static", "reserve", "prefill-first")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2).

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
        bos_token_id: Beginning-of-sequence token id, if any.
        eos_token_ids: Token ids that end generation (EOS and e.g. ``<|eot_id|>``).
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

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token occupies: ``2 · L · n_kv · d_head · b_dtype`` (PagedAttention, §3)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache, resolved (the engine sizes the pool from ``EngineArgs`` first).

    Attributes:
        num_blocks: Blocks in the pool.
        block_size: Tokens per KV block.
        enable_prefix_caching: Register full blocks by content hash and reuse them across requests.
    """

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True

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
        policy: ``"fcfs"`` (arrival order) or ``"priority"`` (lower value first, then arrival).
        mode: How batches form, one of ``SCHEDULING_MODES``.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    policy: str = "fcfs"
    mode: str = "chunked"

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


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs, resolved.

    Attributes:
        model_path: Path of the GGUF file or HF model directory.
        model: The architecture.
        cache: The KV pool.
        scheduler: Step limits (``max_model_len`` resolved).
        dtype: ``"float32"`` or ``"bfloat16"``.
        device: ``"cpu"`` or ``"cuda"``.
        seed: Seed of the engine-wide generator used by unseeded sampled requests.
        log_stats_interval: Seconds between periodic stats log lines (``0`` disables them).
    """

    model_path: str
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    dtype: str = "bfloat16"
    device: str = "cpu"
    seed: int = 0
    log_stats_interval: float = 10.0
