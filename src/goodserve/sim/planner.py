"""Capacity planning: how one GPU's memory divides into weights, a reserve and the paged KV pool, the
concurrency that pool allows, and the whole report of ``goodserve plan``.

Pure functions over :class:`~goodserve.sim.presets.ArchSpec` and
:class:`~goodserve.sim.hardware.HardwareSpec`; no torch. Units are bytes, tokens, FLOPs and seconds
throughout; sizes are per GPU once tensor parallelism (TP) enters. The sizes come from
:mod:`goodserve.sim.model_size` and the decode step times from :mod:`goodserve.sim.roofline`.

The KV cache is priced by the engine's formula, :class:`~goodserve.kv_cache.spec.KVCacheSpec`: a block of
the paged pool (PagedAttention, Kwon et al., SOSP 2023, §3) holds ``block_size`` tokens of every KV-cache
group, and a request keeps, per group, only the blocks its attention can still read (a sliding layer the
blocks overlapping its last ``W`` tokens: Mistral 7B §2, Gemma 3 technical report §2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from goodserve.sim.hardware import GIB, HardwareSpec
from goodserve.kv_cache.spec import KVCacheSpec
from goodserve.sim.model_size import ParamCount, dtype_bytes, kv_cache_spec, param_count, weights_bytes
from goodserve.sim.presets import ArchSpec
from goodserve.sim.roofline import RooflinePoint, decode_roofline, max_batch_for_tpot

# Memory held back from the KV pool for activations, the sampler and CUDA graphs, per GPU (bytes).
DEFAULT_ACTIVATION_RESERVE_BYTES = 1 * GIB
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class MemoryPlan:
    """How one GPU's memory divides between weights, a reserve and the paged KV pool (all bytes).

    Attributes:
        capacity: Device memory.
        usable: ``capacity · gpu_memory_utilization``.
        weights: This GPU's shard of the weights.
        activation_reserve: Held back for activations.
        pool_bytes: ``usable − weights − activation_reserve``, the KV pool.
        kv_spec: The KV-cache groups on this GPU and their dtype (``--kv-cache-dtype``).
        kv_bytes_per_token: KV bytes of one token in every group on this GPU, ``kv_spec.bytes_per_token()``
            (the full-context figure: what a token costs while it is inside every window).
        block_size: Tokens per KV block.
        num_blocks: Whole blocks in the pool, each ``block_size`` tokens of every group:
            ``pool_bytes // (kv_bytes_per_token · block_size)``.
        pool_tokens: ``num_blocks · block_size``.
        context: Tokens per request assumed for concurrency.
        blocks_per_request: Blocks a full-attention layer holds for one request, ``ceil(context / block_size)``
            (a sliding layer holds at most those overlapping its window).
        kv_bytes_per_request: KV bytes one request of ``context`` tokens holds at most, in whole blocks, windows
            applied: ``kv_spec.bytes_for_request(context, block_size)``.
        max_concurrency: Requests of ``context`` tokens that fit at once, ``pool_bytes // kv_bytes_per_request``
            (without windows this equals ``num_blocks // blocks_per_request``).
    """

    capacity: int
    usable: int
    weights: int
    activation_reserve: int
    pool_bytes: int
    kv_spec: KVCacheSpec
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    pool_tokens: int
    context: int
    blocks_per_request: int
    kv_bytes_per_request: int
    max_concurrency: int


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
    kv_cache_dtype: Optional[str] = None,
) -> MemoryPlan:
    """Size the KV pool of one GPU and the concurrency it allows.

    ``pool = capacity · utilisation − weights / tp − reserve``; the pool is cut into blocks of
    ``block_size`` tokens of every KV-cache group (as the engine's paged pool is). A request of ``context``
    tokens holds ``ceil(context / block_size)`` blocks' worth of each full-attention or MLA group and, of a
    sliding group, only the blocks overlapping its window, so ``pool // bytes_for_request(context)``
    requests fit.

    Args:
        arch: The model.
        hw: The accelerator.
        dtype: Weights dtype, ``"bfloat16"``/``"float8"``/``"float32"``.
        tp: Tensor-parallel degree; weights and KV heads are split across ``tp`` GPUs.
        context: Tokens (prompt + output) per request.
        gpu_memory_utilization: Share of device memory goodserve may use, in (0, 1].
        activation_reserve_bytes: Bytes kept back for activations.
        block_size: Tokens per KV block.
        kv_cache_dtype: Dtype of every cached element, a key of
            :data:`~goodserve.kv_cache.spec.KV_DTYPE_BYTES` (``int8`` rows carry a float32 scale);
            ``None`` means ``dtype``.

    Returns:
        A :class:`MemoryPlan`. ``max_concurrency`` is 0 when not even one request fits.

    Raises:
        ValueError: Bad arguments (an unknown KV dtype names the choices), or weights that leave no room for
            a KV pool (suggests ``--tp``).
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
    spec = kv_cache_spec(arch, kv_cache_dtype or dtype, tp)  # validates the KV dtype and tp
    kv_token = spec.bytes_per_token()
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
    per_request = spec.bytes_for_request(context, block_size)
    return MemoryPlan(
        capacity=hw.mem_capacity, usable=usable, weights=weights, activation_reserve=activation_reserve_bytes,
        pool_bytes=pool, kv_spec=spec, kv_bytes_per_token=kv_token, block_size=block_size, num_blocks=num_blocks,
        pool_tokens=num_blocks * block_size, context=context, blocks_per_request=math.ceil(context / block_size),
        kv_bytes_per_request=per_request, max_concurrency=pool // per_request,
    )


@dataclass(frozen=True)
class PlanReport:
    """Everything ``goodserve plan`` prints and plots.

    Attributes:
        arch: The model.
        hw: The accelerator.
        dtype: Weights and compute dtype.
        kv_cache_dtype: Dtype of the cached K/V (or MLA latent) elements.
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
    kv_cache_dtype: str
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
    kv_cache_dtype: Optional[str] = None,
) -> PlanReport:
    """Run the whole plan: memory split, concurrency, decode roofline up to the concurrency limit and the
    largest batch within the TPOT budget. Arguments as in :func:`plan_memory` and :func:`max_batch_for_tpot`.

    Raises:
        ValueError: As :func:`plan_memory`, or a non-positive TPOT budget.
    """
    memory = plan_memory(arch, hw, dtype, tp, context, gpu_memory_utilization, activation_reserve_bytes, block_size,
                         kv_cache_dtype)
    kv_dtype = memory.kv_spec.kv_dtype
    max_batch = max(1, memory.max_concurrency)
    return PlanReport(
        arch=arch, hw=hw, dtype=dtype, kv_cache_dtype=kv_dtype, tp=tp, params=param_count(arch), memory=memory,
        roofline=decode_roofline(arch, hw, context, max_batch, dtype, tp, kv_dtype=kv_dtype),
        tpot_budget_s=tpot_budget_s,
        max_batch_within_tpot=max_batch_for_tpot(arch, hw, context, tpot_budget_s, memory.max_concurrency, dtype, tp,
                                                 kv_dtype),
    )
