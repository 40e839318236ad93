"""Decode roofline: FLOPs and bytes of one decode step and the time the hardware's roofs allow.

Pure functions over :class:`~goodserve.sim.presets.ArchSpec` and :class:`~goodserve.sim.hardware.HardwareSpec`;
no torch. Units are FLOPs, bytes and seconds, per GPU under tensor parallelism (TP).

Source: step time ``max(FLOPs / peak, bytes / bandwidth)`` is the roofline model, Williams, Waterman and
Patterson, "Roofline: an insightful visual performance model", CACM 52(4), 2009.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from goodserve.sim.hardware import HardwareSpec
from goodserve.sim.model_size import dtype_bytes, kv_bytes_read, param_count
from goodserve.sim.presets import ArchSpec


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
    Attention per token and layer is ``2 · n_heads · (d_qk + d_v) · context`` (scores and weighted sum),
    ``min(context, W)`` in place of ``context`` on a sliding-window layer (Mistral 7B §2); for MLA with the
    up-projections absorbed, ``d_qk = d_c + d_h^R`` and ``d_v = d_c`` (DeepSeek-V2 §2.1).
    """
    pc = param_count(arch)
    matmul_params = pc.active - (0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size)
    if arch.is_mla:
        d_qk, d_v = arch.kv_lora_rank + arch.qk_rope_head_dim, arch.kv_lora_rank
    else:
        d_qk = d_v = arch.head_dim
    attn = 2 * arch.num_attention_heads * (d_qk + d_v) * arch.attended_tokens(context)
    return batch * (2 * matmul_params + attn) / tp


def expected_experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct routed experts a layer uses for ``batch`` tokens, each picking ``top_k`` of
    ``num_experts`` uniformly: ``E · (1 − (1 − k/E)^batch)`` (real routers are less uniform)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def decode_bytes(arch: ArchSpec, batch: int, context: int, dtype: str, tp: int = 1,
                 kv_dtype: Optional[str] = None) -> float:
    """Bytes per GPU one decode step reads: the weight shard in ``dtype`` plus, for each of ``batch`` requests,
    the KV a query at ``context`` tokens reads in ``kv_dtype`` (default: ``dtype``): ``context`` tokens of
    every full or MLA layer, at most the window of every sliding one
    (:func:`~goodserve.sim.model_size.kv_bytes_read`).

    Every weight is streamed once per step (an upper bound: an untied embedding table is only gathered).
    For MoE only the experts the batch routes to are read, see :func:`expected_experts_touched`.
    """
    pc = param_count(arch)
    params = pc.total
    if pc.num_moe_layers:
        untouched = arch.num_experts - expected_experts_touched(arch.num_experts, arch.num_experts_per_tok, batch)
        params -= pc.num_moe_layers * untouched * pc.routed_expert
    kv = batch * kv_bytes_read(arch, context, kv_dtype or dtype, tp)
    return params * dtype_bytes(dtype) / tp + kv


def decode_step(
    arch: ArchSpec, hw: HardwareSpec, batch: int, context: int, dtype: str = "bfloat16", tp: int = 1,
    kv_dtype: Optional[str] = None,
) -> RooflinePoint:
    """Roofline time of one decode step: ``max(FLOPs / peak, bytes / bandwidth) + overhead``.

    Compute runs in ``dtype``; the KV cache is read in ``kv_dtype`` (default: ``dtype``). Tensor-parallel
    all-reduces are not modelled.

    Raises:
        ValueError: ``batch`` or ``context`` below 1, unknown dtype.
    """
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be >= 1, got {batch}, {context}")
    flops = decode_flops(arch, batch, context, tp)
    nbytes = decode_bytes(arch, batch, context, dtype, tp, kv_dtype)
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
    batches: Optional[list[int]] = None, kv_dtype: Optional[str] = None,
) -> list[RooflinePoint]:
    """Decode step time for each batch size in ``batches`` (default :func:`batch_sizes` of ``max_batch``)."""
    return [decode_step(arch, hw, b, context, dtype, tp, kv_dtype) for b in (batches or batch_sizes(max_batch))]


def max_batch_for_tpot(
    arch: ArchSpec, hw: HardwareSpec, context: int, tpot_budget_s: float, max_batch: int,
    dtype: str = "bfloat16", tp: int = 1, kv_dtype: Optional[str] = None,
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
        if decode_step(arch, hw, mid, context, dtype, tp, kv_dtype).step_s <= tpot_budget_s:
            lo = mid
        else:
            hi = mid - 1
    return lo
