"""Capacity-planning maths: parameters, weights, KV cache, pool size, concurrency, decode roofline.

Pure functions over :class:`~goodserve.sim.presets.ArchSpec` and
:class:`~goodserve.sim.hardware.HardwareSpec`; no torch. Units are bytes, tokens, FLOPs and seconds
throughout; sizes are per GPU once tensor parallelism (TP) enters.

Sources:
    * KV cache per token ``2 · L · n_kv · d_head · b`` (a K and a V vector per layer and KV head):
      Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
      SOSP 2023, §3.
    * MLA caches one compressed latent plus a shared RoPE key per layer, ``(d_c + d_h^R) · L`` elements:
      DeepSeek-AI, "DeepSeek-V2", arXiv:2405.04434, §2.1 (Table 1).
    * Step time ``max(FLOPs / peak, bytes / bandwidth)``: the roofline model, Williams, Waterman and
      Patterson, "Roofline: an insightful visual performance model", CACM 52(4), 2009.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from goodserve.sim.hardware import GIB, HardwareSpec
from goodserve.sim.presets import ArchSpec

#: Bytes per element of each dtype the planner models, named as the engine's ``--dtype`` names them.
DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float8": 1, "float32": 4}
#: Short spellings the ``plan`` and ``simulate`` command lines still accept (see :func:`parse_dtype`).
DTYPE_ALIASES: dict[str, str] = {"bf16": "bfloat16", "fp8": "float8", "fp32": "float32"}

# Memory held back from the KV pool for activations, the sampler and CUDA graphs, per GPU (bytes).
DEFAULT_ACTIVATION_RESERVE_BYTES = 1 * GIB
DEFAULT_BLOCK_SIZE = 16


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


# ----------------------------------------------------------------------------------------------- params


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


# ------------------------------------------------------------------------------------------------- KV


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


def kv_bytes_per_token(arch: ArchSpec, dtype_nbytes: int, tp: int = 1) -> int:
    """KV-cache bytes one token occupies on one GPU.

    Standard/GQA attention: ``2 · L · n_kv · d_head · b`` (PagedAttention §3), with ``n_kv`` the heads on
    this GPU. MLA: ``(d_c + d_h^R) · L · b`` -- the latent ``c_KV`` and the decoupled RoPE key, no factor 2
    because K and V are both re-projected from the latent (DeepSeek-V2 §2.1); replicated across TP ranks.

    Args:
        arch: The model.
        dtype_nbytes: Bytes per cached element.
        tp: Tensor-parallel degree.

    Returns:
        Bytes per token per GPU. Llama-3-8B in bfloat16: 131,072; DeepSeek-V2 in bfloat16: 69,120.
    """
    if arch.is_mla:
        return (arch.kv_lora_rank + arch.qk_rope_head_dim) * arch.num_hidden_layers * dtype_nbytes
    return 2 * arch.num_hidden_layers * kv_heads_per_gpu(arch, tp) * arch.head_dim * dtype_nbytes


# ----------------------------------------------------------------------------------------------- pool


@dataclass(frozen=True)
class MemoryPlan:
    """How one GPU's memory divides between weights, a reserve and the paged KV pool (all bytes).

    Attributes:
        capacity: Device memory.
        usable: ``capacity · gpu_memory_utilization``.
        weights: This GPU's shard of the weights.
        activation_reserve: Held back for activations.
        pool_bytes: ``usable − weights − activation_reserve``, the KV pool.
        kv_bytes_per_token: KV bytes per token on this GPU.
        block_size: Tokens per KV block.
        num_blocks: Whole blocks in the pool.
        pool_tokens: ``num_blocks · block_size``.
        context: Tokens per request assumed for concurrency.
        blocks_per_request: ``ceil(context / block_size)``.
        max_concurrency: Requests of ``context`` tokens that fit at once.
    """

    capacity: int
    usable: int
    weights: int
    activation_reserve: int
    pool_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    pool_tokens: int
    context: int
    blocks_per_request: int
    max_concurrency: int

    @property
    def kv_bytes_per_request(self) -> int:
        """KV bytes of one request at ``context`` tokens, counted in whole blocks."""
        return self.blocks_per_request * self.block_size * self.kv_bytes_per_token


def suggest_tp(weights: int, usable_minus_reserve: int, max_tp: int = 64) -> Optional[int]:
    """Smallest power-of-two TP degree whose weight shard leaves room in ``usable_minus_reserve`` bytes."""
    tp = 1
    while tp <= max_tp:
        if math.ceil(weights / tp) < usable_minus_reserve:
            return tp
        tp *= 2
    return None


def plan_memory(
    arch: ArchSpec,
    hw: HardwareSpec,
    dtype: str = "bfloat16",
    tp: int = 1,
    context: int = 4096,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> MemoryPlan:
    """Size the KV pool of one GPU and the concurrency it allows.

    ``pool = capacity · utilisation − weights / tp − reserve``; the pool is cut into blocks of
    ``block_size`` tokens (as the engine's paged pool is) and a request of ``context`` tokens needs
    ``ceil(context / block_size)`` blocks on every GPU.

    Args:
        arch: The model.
        hw: The accelerator.
        dtype: Weights and KV dtype, ``"bfloat16"``/``"float8"``/``"float32"``.
        tp: Tensor-parallel degree; weights and KV heads are split across ``tp`` GPUs.
        context: Tokens (prompt + output) per request.
        gpu_memory_utilization: Share of device memory goodserve may use, in (0, 1].
        activation_reserve_bytes: Bytes kept back for activations.
        block_size: Tokens per KV block.

    Returns:
        A :class:`MemoryPlan`. ``max_concurrency`` is 0 when not even one request fits.

    Raises:
        ValueError: Bad arguments, or weights that leave no room for a KV pool (suggests ``--tp``).
    """
    nbytes = dtype_bytes(dtype)
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if activation_reserve_bytes < 0:
        raise ValueError(f"activation reserve must be >= 0 bytes, got {activation_reserve_bytes}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    kv_token = kv_bytes_per_token(arch, nbytes, tp)  # validates tp
    total_weights = weights_bytes(arch, nbytes)
    weights = math.ceil(total_weights / tp)
    usable = int(hw.mem_capacity * gpu_memory_utilization)
    pool = usable - weights - activation_reserve_bytes
    if pool <= 0:
        hint = suggest_tp(total_weights, usable - activation_reserve_bytes)
        advice = f"try --tp {hint}" if hint else "no TP degree up to 64 fits; use a smaller model or dtype"
        raise ValueError(
            f"{arch.name} weights need {weights / GIB:.1f} GiB per GPU in {dtype} at --tp {tp}, but {hw.name} "
            f"offers only {(usable - activation_reserve_bytes) / GIB:.1f} GiB ({hw.mem_capacity / GIB:.1f} GiB "
            f"× {gpu_memory_utilization} − {activation_reserve_bytes / GIB:.1f} GiB activation reserve); {advice}"
        )
    num_blocks = pool // (kv_token * block_size)
    blocks_per_request = math.ceil(context / block_size)
    return MemoryPlan(
        capacity=hw.mem_capacity, usable=usable, weights=weights, activation_reserve=activation_reserve_bytes,
        pool_bytes=pool, kv_bytes_per_token=kv_token, block_size=block_size, num_blocks=num_blocks,
        pool_tokens=num_blocks * block_size, context=context, blocks_per_request=blocks_per_request,
        max_concurrency=num_blocks // blocks_per_request,
    )


# ------------------------------------------------------------------------------------------- roofline


@dataclass(frozen=True)
class RooflinePoint:
    """One decode step of ``batch`` requests, each attending to ``context`` tokens, on one GPU.

    Attributes:
        batch: Requests decoding one token each.
        flops: FLOPs of the step on this GPU.
        bytes: Bytes read from memory on this GPU (weights shard + KV).
        compute_s: ``flops / peak``.
        memory_s: ``bytes / bandwidth``.
        step_s: ``max(compute_s, memory_s) + overhead``.
    """

    batch: int
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    step_s: float

    @property
    def bound(self) -> str:
        """``"memory"`` or ``"compute"``: which roof sets the step time."""
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def tpot_s(self) -> float:
        """Time per output token of each request, seconds (one token per request per step)."""
        return self.step_s

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput of this GPU group, tokens/s."""
        return self.batch / self.step_s

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte read."""
        return self.flops / self.bytes


def decode_flops(arch: ArchSpec, batch: int, context: int, tp: int = 1) -> float:
    """FLOPs per GPU of one decode step: ``batch · (2 · matmul params + attention) / tp``.

    Matmul params are the active parameters minus an untied input embedding (a lookup, not a GEMM).
    Attention per token and layer is ``2 · n_heads · (d_qk + d_v) · context`` (scores and weighted sum);
    for MLA with the up-projections absorbed, ``d_qk = d_c + d_h^R`` and ``d_v = d_c`` (DeepSeek-V2 §2.1).
    """
    pc = param_count(arch)
    matmul_params = pc.active - (0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size)
    if arch.is_mla:
        d_qk, d_v = arch.kv_lora_rank + arch.qk_rope_head_dim, arch.kv_lora_rank
    else:
        d_qk = d_v = arch.head_dim
    attn = 2 * arch.num_attention_heads * (d_qk + d_v) * context * arch.num_hidden_layers
    return batch * (2 * matmul_params + attn) / tp


def expected_experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct routed experts a layer uses for ``batch`` tokens, each picking ``top_k`` of
    ``num_experts`` uniformly: ``E · (1 − (1 − k/E)^batch)`` (real routers are less uniform)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def decode_bytes(arch: ArchSpec, batch: int, context: int, dtype_nbytes: int, tp: int = 1) -> float:
    """Bytes per GPU one decode step reads: the weight shard plus ``batch · context`` tokens of KV.

    Every weight is streamed once per step (an upper bound: an untied embedding table is only gathered).
    For MoE only the experts the batch routes to are read, see :func:`expected_experts_touched`.
    """
    pc = param_count(arch)
    params = pc.total
    if pc.num_moe_layers:
        untouched = arch.num_experts - expected_experts_touched(arch.num_experts, arch.num_experts_per_tok, batch)
        params -= pc.num_moe_layers * untouched * pc.routed_expert
    kv = batch * context * kv_bytes_per_token(arch, dtype_nbytes, tp)
    return params * dtype_nbytes / tp + kv


def decode_step(
    arch: ArchSpec, hw: HardwareSpec, batch: int, context: int, dtype: str = "bfloat16", tp: int = 1
) -> RooflinePoint:
    """Roofline time of one decode step: ``max(FLOPs / peak, bytes / bandwidth) + overhead``.

    Tensor-parallel all-reduces are not modelled.

    Raises:
        ValueError: ``batch`` or ``context`` below 1, unknown dtype.
    """
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be >= 1, got {batch}, {context}")
    flops = decode_flops(arch, batch, context, tp)
    nbytes = decode_bytes(arch, batch, context, dtype_bytes(dtype), tp)
    compute_s = flops / hw.peak_flops(dtype)
    memory_s = nbytes / hw.mem_bandwidth
    return RooflinePoint(batch, flops, nbytes, compute_s, memory_s, max(compute_s, memory_s) + hw.step_overhead_s)


def batch_sizes(max_batch: int) -> list[int]:
    """Powers of two up to ``max_batch``, and ``max_batch`` itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max(1, max_batch)]


def decode_roofline(
    arch: ArchSpec, hw: HardwareSpec, context: int, max_batch: int, dtype: str = "bfloat16", tp: int = 1,
    batches: Optional[list[int]] = None,
) -> list[RooflinePoint]:
    """Decode step time for each batch size in ``batches`` (default :func:`batch_sizes` of ``max_batch``)."""
    return [decode_step(arch, hw, b, context, dtype, tp) for b in (batches or batch_sizes(max_batch))]


def max_batch_for_tpot(
    arch: ArchSpec, hw: HardwareSpec, context: int, tpot_budget_s: float, max_batch: int,
    dtype: str = "bfloat16", tp: int = 1,
) -> int:
    """Largest batch ``<= max_batch`` whose decode TPOT stays within ``tpot_budget_s`` seconds.

    Step time never decreases with batch size, so this is a binary search.

    Returns:
        The batch size, or 0 if even batch 1 misses the budget (or ``max_batch`` is 0).

    Raises:
        ValueError: Non-positive budget.
    """
    if tpot_budget_s <= 0:
        raise ValueError(f"TPOT budget must be > 0, got {tpot_budget_s}")
    lo, hi = 0, max_batch  # invariant: lo meets the budget (0 trivially), answers lie in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if decode_step(arch, hw, mid, context, dtype, tp).step_s <= tpot_budget_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --------------------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class PlanReport:
    """Everything ``goodserve plan`` prints and plots.

    Attributes:
        arch: The model.
        hw: The accelerator.
        dtype: Weights/KV/compute dtype.
        tp: Tensor-parallel degree.
        params: Parameter counts.
        memory: Per-GPU memory plan.
        roofline: Decode steps at :func:`batch_sizes` of the concurrency limit.
        tpot_budget_s: TPOT budget, seconds.
        max_batch_within_tpot: Largest batch meeting the budget (0 if none).
    """

    arch: ArchSpec
    hw: HardwareSpec
    dtype: str
    tp: int
    params: ParamCount
    memory: MemoryPlan
    roofline: list[RooflinePoint]
    tpot_budget_s: float
    max_batch_within_tpot: int

    @property
    def roofline_max_batch(self) -> int:
        """Largest batch in the roofline: the concurrency limit, at least 1."""
        return max(1, self.memory.max_concurrency)


def make_plan(
    arch: ArchSpec,
    hw: HardwareSpec,
    dtype: str = "bfloat16",
    tp: int = 1,
    context: int = 4096,
    gpu_memory_utilization: float = 0.9,
    tpot_budget_s: float = 0.05,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> PlanReport:
    """Run the whole plan: memory split, concurrency, decode roofline up to the concurrency limit and the
    largest batch within the TPOT budget. Arguments as in :func:`plan_memory` and :func:`max_batch_for_tpot`.

    Raises:
        ValueError: As :func:`plan_memory`, or a non-positive TPOT budget.
    """
    memory = plan_memory(arch, hw, dtype, tp, context, gpu_memory_utilization, activation_reserve_bytes, block_size)
    max_batch = max(1, memory.max_concurrency)
    return PlanReport(
        arch=arch, hw=hw, dtype=dtype, tp=tp, params=param_count(arch), memory=memory,
        roofline=decode_roofline(arch, hw, context, max_batch, dtype, tp),
        tpot_budget_s=tpot_budget_s,
        max_batch_within_tpot=max_batch_for_tpot(arch, hw, context, tpot_budget_s, memory.max_concurrency, dtype, tp),
    )
