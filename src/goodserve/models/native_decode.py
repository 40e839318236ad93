"""The decode step in one native call (``csrc/decode_step.cpp``): :class:`DecodeLayers` gathers a model's
operands once, :func:`decode_layers` runs a step of decode rows through every layer with them. The kernels it
strings together are :mod:`goodserve.models.native`'s; so are the checks and errors of the ops.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

import torch

from goodserve.models.native import BLOCK_KINDS, _ops, num_splits

#: The most rows :func:`decode_layers` takes: two passes of the block kernel over each weight, still fewer
#: bytes than one pass over dense bfloat16 copies. Past this the layer-by-layer path on dense copies was the
#: faster one (BENCHMARKS.md, "Against llama.cpp on the same GGUF", run 7).
DECODE_STEP_MAX_ROWS = 8
#: The most parts side by side in one projection of :func:`decode_layers` (``kParts`` of ``csrc/decode_step.cpp``).
DECODE_STEP_PARTS = 3
#: The most rows :func:`decode_layers` takes on batch-invariant GEMMs: the default token budget. Up to it, on the
#: default model, a step in one call was faster than layer by layer at every size measured (BENCHMARKS.md,
#: "Speculative decoding: rows with drafts in one call, batch-invariant").
INVARIANT_DECODE_MAX_ROWS = 1024
#: Kind codes past this one in :class:`DecodeLayers` are the batch-invariant GEMM's (``csrc/decode_step.cpp``).
INVARIANT_KIND = 16

@dataclass
class MoeOperands:
    """A mixture-of-experts layer of :func:`decode_layers` (``csrc/moe_step.cpp``, as
    :meth:`goodserve.models.moe_blocks.BlockExperts.mlp_in_one_call` runs it).

    Attributes:
        router: ``[num_experts, hidden]`` in the activations' dtype, contiguous.
        part_ptrs, part_ints: :class:`~goodserve.models.moe_blocks.BlockExperts`' ``[3, 6]`` int64 and
            ``[3, 3]`` int32 operands of its experts' blocks.
        num_experts, top_k, renormalise, scaling, float32_weighting: The routing, as
            :func:`goodserve.models.moe.route` and :class:`goodserve.models.moe.SparseMoeBlock` take it.
    """

    router: torch.Tensor
    part_ptrs: torch.Tensor
    part_ints: torch.Tensor
    num_experts: int
    top_k: int
    renormalise: bool
    scaling: float
    float32_weighting: bool

    def pointers(self) -> list[int]:
        """The layer's ``kMoePointers`` addresses of ``csrc/decode_step.cpp``: the router's, then the parts'."""
        return [self.router.data_ptr()] + self.part_ptrs.reshape(-1).tolist()

    def ints(self) -> list[int]:
        """The layer's ``kMoeInts``: the parts' ints, then the routing (the scaling as its float32 bits)."""
        scaling_bits = struct.unpack("<i", struct.pack("<f", self.scaling))[0]
        return self.part_ints.reshape(-1).tolist() + [self.num_experts, self.top_k, int(self.renormalise),
                                                      int(self.float32_weighting), scaling_bits]


#: A dense layer's ``kMoePointers`` and ``kMoeInts`` (``csrc/decode_step.cpp``): zeros.
_NO_MOE = ([0] * 19, [0] * 14)


class DecodeLayers:
    """:func:`decode_layers`' per-model operands: the addresses of every layer's weights, gathered once.

    Args:
        layers: Per layer ``(input_norm, post_norm, projections, qk_norm, moe)``: the norms' ``[hidden]``
            weights, the qkv, o, gate_up and down projections (qkv and o only for a mixture-of-experts layer),
            the ``[num_heads + num_kv_heads, head_dim]`` weight of the q/k norms (Qwen3's,
            :func:`~goodserve.models.native.head_rms_norm` before RoPE) or ``None``, and the layer's experts
            on blocks as :class:`MoeOperands`, or ``None`` for a dense MLP.
            Each projection is a list of 1 to :data:`DECODE_STEP_PARTS` parts side by side along the outputs
            (q/k/v or gate/up held in different block types), each part ``(kind, codes, scales, mins, offset,
            rows)``: a kind of :data:`~goodserve.models.native.BLOCK_KINDS` with the operands
            :func:`~goodserve.models.native.block_gemv` takes (checked by
            :func:`~goodserve.models.native.check_blocks`), or an int ``INVARIANT_KIND + k`` with the
            batch-invariant GEMM's kind ``k`` and operands (:class:`goodserve.models.invariant.InvariantLinear`);
            ``rows`` its output features.
        shape: ``(hidden, num_heads, num_kv_heads, head_dim, intermediate)``.
        eps: The norms' epsilon.
        final_norm: ``[hidden]`` weight of the norm after the last layer.

    The tensors must stay where they are while this object is used (it holds references to them).
    """

    def __init__(self, layers: list, shape: tuple[int, int, int, int, int], eps: float,
                 final_norm: torch.Tensor) -> None:
        self.shape, self.eps, self.final_norm = shape, eps, final_norm
        self.dtype = final_norm.dtype
        self._keep = layers
        ptrs, ints = [], []
        invariant = True
        for input_norm, post_norm, projections, qk_norm, moe in layers:
            row = [input_norm.data_ptr(), post_norm.data_ptr()]
            kinds = []
            if len(projections) != (2 if moe else 4):
                raise ValueError("a layer of the decode step has qkv, o, gate_up and down projections (a mixture "
                                 "of experts' layer qkv and o)")
            for parts in projections + [[], []] * (moe is not None):  # an MoE layer's gate_up and down: none
                if not (moe is not None and not parts) and not 1 <= len(parts) <= DECODE_STEP_PARTS:
                    raise ValueError(f"a projection of the decode step has 1 to {DECODE_STEP_PARTS} parts")
                for kind, codes, scales, mins, offset, rows in parts:
                    row += [t.data_ptr() if t is not None else 0 for t in (codes, scales, mins)]
                    invariant = invariant and isinstance(kind, int)
                    kinds += [kind if isinstance(kind, int) else BLOCK_KINDS[kind], int(offset), int(rows)]
                row += [0] * 3 * (DECODE_STEP_PARTS - len(parts))
                kinds += [0] * 3 * (DECODE_STEP_PARTS - len(parts))
            ptrs.append(row + [0 if qk_norm is None else qk_norm.data_ptr()]
                        + (_NO_MOE[0] if moe is None else moe.pointers()))
            ints.append(kinds + (_NO_MOE[1] if moe is None else moe.ints()))
        #: The most rows a call takes: the block kernel reads its weights once per 4 rows, the
        #: batch-invariant GEMM once per call.
        self.max_rows = INVARIANT_DECODE_MAX_ROWS if invariant else DECODE_STEP_MAX_ROWS
        self.layer_ptrs = torch.tensor(ptrs, dtype=torch.int64)
        self.layer_ints = torch.tensor(ints, dtype=torch.int32)
        self._caches: Optional[tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = None  # (addresses, K, V)

    def cache_addresses(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_layers]`` int64 addresses of the K and of the V caches (checked and gathered once per pool).

        Raises:
            ValueError: for caches of another layer count, dtype or head shape, or not contiguous.
        """
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if self._caches is None or self._caches[0] != key:
            shape = kv_caches[0][0].shape if kv_caches else None
            if len(kv_caches) != self.layer_ptrs.shape[0] or any(
                    t.dtype != self.dtype or not t.is_contiguous() or t.shape != shape
                    or tuple(t.shape[2:]) != self.shape[2:4] for pair in kv_caches for t in pair):
                raise ValueError(f"the decode step needs {self.layer_ptrs.shape[0]} pairs of contiguous {self.dtype} "
                                 f"caches [num_blocks, block_size, {self.shape[2]}, {self.shape[3]}] of one shape")
            k = torch.tensor(key[0::2], dtype=torch.int64)
            v = torch.tensor(key[1::2], dtype=torch.int64)
            self._caches = (key, k, v)
        return self._caches[1], self._caches[2]


def decode_layers(plan: DecodeLayers, embeddings: torch.Tensor, positions: torch.Tensor,
                  kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                  rope_table: torch.Tensor, split_tokens: Optional[int] = None,
                  amx_attention: bool = False, run_starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A decode step through every layer and the final norm, one query token per row, in one call.

    Each layer is the pre-norm attention + SwiGLU block of ``models/llama.py`` (``DecoderLayer.forward``)
    on the same kernels (:mod:`goodserve.models.native`): ``rms_norm``, the q/k norms where the model has them
    (``head_rms_norm``), ``rope``, every row's new K/V written to its slot, then ``paged_decode_attention``
    and ``block_gemv`` for the projections; a mixture of experts' MLP is ``moe_block`` (``csrc/moe_step.cpp``).
    Since every row's K/V is in the cache before any row attends, several rows may be consecutive tokens of
    one request (a short chunk, :func:`goodserve.models.short_rows.decode_rows`): each attends its
    ``seq_lens`` tokens, its chunk's earlier tokens included.

    Args:
        plan: The model's operands.
        embeddings: ``[rows, hidden]`` (1 to ``plan.max_rows`` rows), contiguous, ``plan.dtype``.
        positions: ``[rows]`` int64.
        kv_caches: Per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous.
        slot_mapping: ``[rows]`` int64 cache slot of each new token.
        block_tables, seq_lens, max_len: As :func:`~goodserve.models.native.paged_decode_attention` takes them.
        rope_table: ``[2, max_positions, head_dim]`` cos and sin, contiguous, ``plan.dtype``.
        split_tokens: As :func:`~goodserve.models.native.paged_decode_attention` takes it.
        amx_attention: Attend on the batch-invariant AMX kernel (``csrc/paged_attention_amx.cpp``, bfloat16)
            instead of :func:`~goodserve.models.native.paged_decode_attention`.
        run_starts: With ``amx_attention``, ``[num_runs + 1]`` int32 first row of each run of rows that share
            their context's K/V tiles (:func:`goodserve.models.invariant_attention.run_starts`: a chunk's
            tokens), as the layer-by-layer path attends them; ``None``: every row its own run. Each row's output
            is the same either way; a chunk of ``n`` tokens read as one run reads its context once, not ``n``
            times.

    Returns:
        ``[rows, hidden]``: the hidden states after the final norm.

    Raises:
        RuntimeError: if a kernel refuses the call. ValueError: for inputs of another shape or dtype.
    """
    ops = _ops(embeddings)
    rows = embeddings.shape[0]
    hidden, num_heads, num_kv_heads, head_dim, inter = plan.shape
    if embeddings.dtype != plan.dtype or embeddings.shape != (rows, hidden) or not embeddings.is_contiguous() \
            or not 1 <= rows <= plan.max_rows or rope_table.dtype != plan.dtype:
        raise ValueError(f"embeddings must be [1..{plan.max_rows}, {hidden}] {plan.dtype}, contiguous")
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64 or block_tables.dtype != torch.int32 \
            or seq_lens.dtype != torch.int32 or block_tables.shape[0] != rows or seq_lens.shape != (rows,):
        raise ValueError("positions and slot_mapping must be int64, block_tables and seq_lens int32, one row each")
    if positions.shape != (rows,) or slot_mapping.shape != (rows,):
        raise ValueError("positions and slot_mapping must hold one entry per row")
    if run_starts is not None and (run_starts.dtype != torch.int32 or run_starts.dim() != 1
                                   or not run_starts.is_contiguous() or run_starts.shape[0] < 2
                                   or int(run_starts[0]) != 0 or int(run_starts[-1]) != rows):
        raise ValueError(f"run_starts must be contiguous int32 [num_runs + 1] from 0 to the {rows} rows")
    k_addr, v_addr = plan.cache_addresses(kv_caches)
    block_size = kv_caches[0][0].shape[1]
    if split_tokens is None:
        splits = num_splits(rows, max_len, torch.get_num_threads())
        split_tokens = -(-max_len // splits)
    else:
        splits = -(-max_len // split_tokens)
    return ops.decode_layers(plan.layer_ptrs, plan.layer_ints, k_addr, v_addr, embeddings, positions, slot_mapping,
                             block_tables, seq_lens, rope_table, plan.final_norm, list(plan.shape), plan.eps,
                             block_size, split_tokens, splits, amx_attention, run_starts)
