"""How big a model is: bytes per dtype, parameter counts, weights bytes and KV-cache bytes per token.

Pure functions over :class:`~goodserve.sim.presets.ArchSpec`; no torch. Units are bytes and parameters;
sizes are per GPU once tensor parallelism (TP) enters.

Sources:
    * KV cache per token ``2 · L · n_kv · d_head · b`` (a K and a V vector per layer and KV head):
      Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
      SOSP 2023, §3.
    * MLA caches one compressed latent plus a shared RoPE key per layer, ``(d_c + d_h^R) · L`` elements:
      DeepSeek-AI, "DeepSeek-V2", arXiv:2405.04434, §2.1 (Table 1).
    * A sliding-window layer only ever reads the last ``W`` tokens (Jiang et al., "Mistral 7B", 2023, §2;
      Gemma Team, "Gemma 3 Technical Report", 2025, §2: five local layers of 1024 tokens per global one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from goodserve.kv_cache.layout import KVCacheLayout, plan_layout
from goodserve.kv_cache.spec import KVCacheGroup, KVCacheSpec, mla_spec
from goodserve.sim.presets import ArchSpec

#: Bytes per element of each dtype the planner models, named as the engine's ``--dtype`` names them.
DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float8": 1, "float32": 4}
#: Short spellings the ``plan`` and ``simulate`` command lines still accept (see :func:`parse_dtype`).
DTYPE_ALIASES: dict[str, str] = {"bf16": "bfloat16", "fp8": "float8", "fp32": "float32"}


def parse_dtype(text: str) -> str:
    """A ``--dtype`` value in the engine's spelling: a short alias (``"bf16"``) becomes ``"bfloat16"``.

    Anything else passes through unchanged, for argparse's ``choices`` to accept or refuse.
    """
    return DTYPE_ALIASES.get(text, text)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``"bfloat16"``, ``"float8"`` or ``"float32"``.

    Raises:
        ValueError: Unknown dtype.
    """
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of a model.

    Attributes:
        total: Every parameter; all must be resident, so this sets the weights memory.
        active: Parameters one token touches (differs from ``total`` only for MoE); sets decode FLOPs.
        routed_expert: Parameters of one routed expert's MLP (0 for dense models).
        num_moe_layers: Layers whose MLP is a mixture of experts.
    """

    total: int
    active: int
    routed_expert: int = 0
    num_moe_layers: int = 0


def _attention_params(a: ArchSpec) -> int:
    h, nh = a.hidden_size, a.num_attention_heads
    if a.is_mla:
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank:
            q = h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * nh * qk  # down, norm, up
        else:
            q = h * nh * qk
        kv = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank  # down (+ shared RoPE key), norm
        kv += a.kv_lora_rank * nh * (a.qk_nope_head_dim + a.v_head_dim)  # up to per-head K_nope and V
        return q + kv + nh * a.v_head_dim * h
    q_out, kv_out = nh * a.head_dim, a.num_key_value_heads * a.head_dim
    bias = q_out + 2 * kv_out if a.attention_bias else 0
    return h * q_out + 2 * h * kv_out + q_out * h + bias


def param_count(arch: ArchSpec) -> ParamCount:
    """Count parameters from the architecture (SwiGLU MLP, RMSNorm, no biases except Qwen2's q/k/v).

    Per layer: attention projections, the MLP (``3 · H · I``; an MoE layer has a router ``H · E`` and
    ``E`` routed plus the shared experts), two norms. Plus the embedding, the LM head unless tied, and
    the final norm. Llama-3-8B gives 8,030,261,248, the published 8.03B.

    Returns:
        A :class:`ParamCount`.
    """
    h = arch.hidden_size
    dense_mlp = 3 * h * arch.intermediate_size
    expert = 3 * h * arch.moe_intermediate_size
    attn = _attention_params(arch) + 2 * h
    n_moe = arch.num_hidden_layers - arch.first_k_dense_layers if arch.is_moe else 0
    n_dense = arch.num_hidden_layers - n_moe
    moe_layer_common = h * arch.num_experts + arch.num_shared_experts * expert  # router + shared experts
    embed = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2) + h
    total = embed + arch.num_hidden_layers * attn + n_dense * dense_mlp
    total += n_moe * (moe_layer_common + arch.num_experts * expert)
    active = total - n_moe * (arch.num_experts - arch.num_experts_per_tok) * expert
    return ParamCount(total=total, active=active, routed_expert=expert if n_moe else 0, num_moe_layers=n_moe)


def weights_bytes(arch: ArchSpec, dtype_nbytes: int) -> int:
    """Bytes of all weights (every expert of an MoE model) at ``dtype_nbytes`` per parameter."""
    return param_count(arch).total * dtype_nbytes


def kv_heads_per_gpu(arch: ArchSpec, tp: int) -> int:
    """KV heads each GPU stores under tensor parallelism of degree ``tp``.

    Heads are split evenly; when ``tp`` exceeds ``n_kv`` each GPU keeps a replica of one head
    (as vLLM does). MLA's latent is not split by head and is replicated on every GPU.

    Raises:
        ValueError: ``tp`` neither divides nor is a multiple of ``n_kv``.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    n_kv = arch.num_key_value_heads
    if n_kv % tp == 0:
        return n_kv // tp
    if tp % n_kv == 0:
        return 1
    raise ValueError(f"--tp {tp} cannot split {n_kv} KV heads evenly; use a divisor or multiple of {n_kv}")


def kv_cache_spec(arch: ArchSpec, kv_dtype: str, tp: int = 1) -> KVCacheSpec:
    """The KV-cache groups of ``arch`` on one GPU, every element in ``kv_dtype``: the engine's own formula
    (:mod:`goodserve.kv_cache.spec`), with the KV heads of this GPU under tensor parallelism.

    A model with sliding layers gets a ``full`` group of its global layers (if any) and a ``sliding`` group
    of ``num_sliding_layers`` layers with its window: the ideal. The engine's groups are of equal size
    (:func:`kv_cache_layout`), so a partial last group of a kind costs a few padded layers more
    (docs/kv-memory.md). MLA caches the latent ``c_KV`` and the decoupled RoPE key, replicated across TP ranks
    (DeepSeek-V2 §2.1).

    Raises:
        ValueError: an unknown ``kv_dtype``, or a ``tp`` that cannot split the KV heads.
    """
    if arch.is_mla:
        return mla_spec(arch.num_hidden_layers, arch.kv_lora_rank, arch.qk_rope_head_dim, kv_dtype)
    n_kv = kv_heads_per_gpu(arch, tp)
    num_full = arch.num_hidden_layers - arch.num_sliding_layers
    groups = []
    if num_full:
        groups.append(KVCacheGroup("full", num_full, n_kv, arch.head_dim))
    if arch.num_sliding_layers:
        groups.append(KVCacheGroup("sliding", arch.num_sliding_layers, n_kv, arch.head_dim, arch.sliding_window))
    return KVCacheSpec(kv_dtype, tuple(groups))


def kv_cache_layout(arch: ArchSpec) -> KVCacheLayout:
    """The engine's layout of ``arch``'s layers over its KV pool (:func:`goodserve.kv_cache.layout.plan_layout`):
    where the sliding layers sit does not change it, only how many there are."""
    num_full = arch.num_hidden_layers - arch.num_sliding_layers
    return plan_layout([None] * num_full + [arch.sliding_window] * arch.num_sliding_layers)


def kv_page_bytes(arch: ArchSpec, kv_dtype: str, block_size: int, tp: int = 1,
                  layout: Optional[KVCacheLayout] = None) -> int:
    """Bytes of one block of the engine's KV pool on one GPU: ``block_size`` tokens of every layer, or of one
    group's layers when ``layout`` (default :func:`kv_cache_layout`) has several groups."""
    layout = layout or kv_cache_layout(arch)
    if layout.num_groups == 1:
        return block_size * kv_cache_spec(arch, kv_dtype, tp).bytes_per_token()
    return layout.spec(kv_dtype, kv_heads_per_gpu(arch, tp), arch.head_dim).page_bytes(block_size)


def kv_bytes_per_token(arch: ArchSpec, kv_dtype: str, tp: int = 1) -> int:
    """KV-cache bytes one token occupies on one GPU while it is inside every window (:func:`kv_cache_spec`).

    Standard/GQA attention: ``2 · L · n_kv · d_head · b`` (PagedAttention §3), with ``n_kv`` the heads on
    this GPU. MLA: ``(d_c + d_h^R) · L · b`` (DeepSeek-V2 §2.1). An ``int8`` row adds its float32 scale.
    Windows do not shrink this figure; what a whole request keeps is
    :meth:`~goodserve.kv_cache.spec.KVCacheSpec.bytes_for_request`.

    Args:
        arch: The model.
        kv_dtype: Dtype of every cached element (a key of :data:`~goodserve.kv_cache.spec.KV_DTYPE_BYTES`).
        tp: Tensor-parallel degree.

    Returns:
        Bytes per token per GPU. Llama-3-8B in bfloat16: 131,072; DeepSeek-V2 in bfloat16: 69,120.
    """
    return kv_cache_spec(arch, kv_dtype, tp).bytes_per_token()


def kv_bytes_read(arch: ArchSpec, context: int, kv_dtype: str, tp: int = 1) -> int:
    """KV bytes one query at ``context`` tokens reads on one GPU: every cached token of a full or MLA layer,
    at most the window's ``W`` tokens of a sliding one (Mistral 7B §2).

    Raises:
        ValueError: as :func:`kv_cache_spec`.
    """
    spec = kv_cache_spec(arch, kv_dtype, tp)
    return sum(g.bytes_per_token(kv_dtype) * min(context, g.window or context) for g in spec.groups)
