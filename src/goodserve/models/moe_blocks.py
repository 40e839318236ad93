"""A GGUF mixture of experts' quantized experts kept as the file's blocks, run on the native block kernel.

llama.cpp's ``qwen3moe`` files stack each layer's experts in 3-D tensors (``ffn_gate_exps`` / ``ffn_up_exps``
``[E, I, hidden]``, ``ffn_down_exps`` ``[E, hidden, I]``), expert ``e``'s rows one contiguous run of blocks.
:func:`unpack_gguf_experts` cuts them per expert and holds every expert's operands of
:func:`goodserve.models.native.block_gemv` stacked (:class:`StackedBlocks`: the file's codes, scales and
minimums, nothing re-rounded: :func:`goodserve.models.quant.pack_blocks`), so the experts stay at the file's
bits per weight (Q4_0: 4.5) instead of bfloat16's 16.

:class:`BlockExperts` runs one expert's SwiGLU on those operands for the grouped-by-expert computation of
:func:`goodserve.models.moe.grouped_by_expert` (tokens sorted by expert, one gate/up and one down product
per active expert). As :class:`goodserve.models.quant.QuantLinear` does for a dense projection, an expert's
steps of at most ``max_rows`` rows run on the block kernel and larger ones on a dense copy of that expert,
made from its codes once the larger steps have brought it ``dense_after_rows`` rows (the ski-rental rule of
:data:`goodserve.models.quant.DENSE_AFTER_ROWS`), per expert: a decode step (a few rows per expert) never
makes one. :func:`goodserve.models.quant.make_dense_copies` (a server, before its first step) leaves the
experts alone: copies of every expert are the memory the blocks save.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from goodserve.models import native
from goodserve.models.kquant import KQUANT_TYPES, unpack_gguf_kquant
from goodserve.models.linear import dense_linear
from goodserve.models.native_decode import DECODE_STEP_MAX_ROWS
from goodserve.models.q5 import Q5_TYPES, unpack_gguf_q5
from goodserve.models.quant import (BLOCK_TYPES, DENSE_AFTER_ROWS, BlockQuantized, dequantize_rows, pack_blocks,
                                    unpack_blocks, unpack_gguf_blocks)

#: HF ``model_type`` of the GGUF architectures whose experts :func:`goodserve.models.gguf_file.load_gguf` keeps as
#: blocks (``qwen3moe``; DeepSeek-V2's experts still run dense).
BLOCK_EXPERT_ARCHITECTURES = ("qwen3_moe",)

#: An expert's steps of more rows than this run on its dense copy, once made. Higher than a dense projection's
#: :data:`goodserve.models.quant.DEFAULT_MAX_ROWS` (4) for memory, not speed: a batch-64 decode step of a
#: 128-expert top-8 model gives an expert 4 rows on average (Poisson: more than 12 about once in 3,700), so
#: at 4 half the experts' rows would count towards a copy and a few hundred such steps would copy every
#: expert to bfloat16, 3.6x the bytes of a Q4_0 file's experts. The price, measured on this repository's CPU
#: (2 threads, 64 experts of Qwen3-30B-A3B's shape, hidden 2048, width 768, in Q4_1; gate/up and down per
#: expert): 1 row 0.29 ms on the kernel against 0.49 ms on the copy, 4 rows 0.43 / 0.40, 8 rows 0.66 / 0.44,
#: 12 rows 0.95 / 0.50.
EXPERT_MAX_ROWS = 12
#: Steps of at most this many rows, the one-call decode step's, run the whole MoE MLP in one native call
#: (:meth:`BlockExperts.mlp_in_one_call`): no expert gets more rows than the step has, so every expert runs on
#: the kernel, as :meth:`BlockExperts.run_sorted` runs it (``EXPERT_MAX_ROWS`` is higher).
ONE_CALL_MAX_ROWS = DECODE_STEP_MAX_ROWS

_UNPACKERS: dict[str, Callable[[np.ndarray, str, tuple[int, int]], BlockQuantized]] = {
    **{t: unpack_gguf_blocks for t in BLOCK_TYPES}, **{t: unpack_gguf_q5 for t in Q5_TYPES},
    **{t: unpack_gguf_kquant for t in KQUANT_TYPES}}
#: GGUF types :func:`unpack_gguf_experts` takes.
EXPERT_BLOCK_TYPES = tuple(_UNPACKERS)


@dataclass
class StackedBlocks:
    """``E`` experts' ``[N, K]`` weights of one GGUF block type, as :func:`goodserve.models.native.block_gemv`'s
    operands stacked along a leading expert axis (expert ``e``'s are ``codes[e]``, ``scales[e]``, ``mins[e]``:
    see :func:`goodserve.models.quant.pack_blocks` for each type's layout).

    Attributes:
        qtype: The GGUF type (``"Q4_0"``, ``"Q8_0"``, ``"Q4_K"``, ...).
        codes: ``[E, N, bytes per row]`` uint8.
        scales: ``[E, N, ...]`` float16.
        mins: ``[E, N, ...]`` (Q4_1 / Q5_1 float16; K-quants' 8-bit sub-block scales), or ``None``.
        offset: Subtracted from each code (``pack_blocks``' offset of the type).
        in_features: ``K``.
    """

    qtype: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: Optional[torch.Tensor]
    offset: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, N, K)``."""
        return self.codes.shape[0], self.codes.shape[1], self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes of all experts' operands."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)

    def expert(self, e: int) -> BlockQuantized:
        """Expert ``e``'s weight (views of the stacked operands)."""
        return unpack_blocks(self.qtype, self.codes[e], self.scales[e], None if self.mins is None else self.mins[e])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """``[E, N, K]`` in ``dtype``: each expert dequantized as ``gguf.quants.dequantize`` does (float32), then
        cast, one expert at a time."""
        e, n, k = self.shape
        out = torch.empty(e, n, k, dtype=dtype)
        for i in range(e):
            out[i] = dequantize_rows(self.expert(i), dtype)
        return out

    @staticmethod
    def cat_rows(parts: list["StackedBlocks"]) -> "StackedBlocks":
        """Each expert's parts stacked along its output rows (gate rows then up rows).

        Raises:
            ValueError: for parts of different types or input features.
        """
        if len({(p.qtype, p.in_features, p.shape[0]) for p in parts}) != 1:
            raise ValueError(f"cannot fuse experts of different types or shapes "
                             f"{sorted({(p.qtype, p.shape) for p in parts})}")
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts], dim=1)
        return StackedBlocks(parts[0].qtype, torch.cat([p.codes for p in parts], dim=1),
                             torch.cat([p.scales for p in parts], dim=1), mins, parts[0].offset, parts[0].in_features)


def unpack_gguf_experts(data: np.ndarray, qtype: str, shape: tuple[int, int, int]) -> StackedBlocks:
    """A GGUF 3-D expert tensor's raw bytes as :class:`StackedBlocks`, one expert at a time (the unpacked codes
    of one expert are the only transient copy).

    Args:
        data: ``[E, N, bytes_per_row]`` uint8 as the GGUF reader maps it (or any shape of the same bytes).
        qtype: One of :data:`EXPERT_BLOCK_TYPES`.
        shape: ``(E, N, K)``: experts, output rows, input features (GGUF ``ne`` reversed).

    Returns:
        The stacked operands; ``expert(e).dequantize()`` equals ``gguf.quants.dequantize`` of expert ``e``'s
        bytes exactly.

    Raises:
        ValueError: for a type outside :data:`EXPERT_BLOCK_TYPES`, or a byte count that does not match ``shape``.
    """
    if qtype not in _UNPACKERS:
        raise ValueError(f"no block layout for GGUF type {qtype}; expert blocks take {', '.join(EXPERT_BLOCK_TYPES)}")
    e, n, k = shape
    if data.size % e:
        raise ValueError(f"GGUF {qtype} tensor of {data.size} bytes does not hold {e} experts")
    per_expert = np.ascontiguousarray(data).reshape(e, data.size // e)
    codes, scales, mins, offset = [], [], [], 0
    for i in range(e):
        c, s, m, offset = pack_blocks(_UNPACKERS[qtype](per_expert[i].reshape(n, -1), qtype, (n, k)))
        codes.append(c)
        scales.append(s)
        mins.append(m)
    return StackedBlocks(qtype, torch.stack(codes), torch.stack(scales),
                         None if mins[0] is None else torch.stack(mins), offset, k)


def runs_on_blocks(weights: list[StackedBlocks], dtype: torch.dtype) -> bool:
    """Whether ``--quantization auto`` runs these experts' weights on the block kernel: activations of a dtype
    :func:`goodserve.models.native.blocks_run_in` allows, every weight of a shape the kernel takes (``K`` a
    multiple of 64 up to 16,384, of 256 for the K-quants; ``N`` a multiple of 16)."""
    return native.blocks_run_in(dtype) and all(native.block_gemv_fits(n, k) for _, n, k in (w.shape for w in weights))


def experts_mix(weights: dict[str, object]) -> str:
    """The types of the :class:`StackedBlocks` among ``weights`` with their counts, most frequent first (ties by
    name), as :func:`goodserve.models.gguf_file.tensor_type_mix` writes them; ``""`` when there are none."""
    counts: dict[str, int] = {}
    for value in weights.values():
        for part in value if isinstance(value, list) else [value]:
            if isinstance(part, StackedBlocks):
                counts[part.qtype] = counts.get(part.qtype, 0) + 1
    return ", ".join(f"{name} ×{n}" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


class BlockExperts(nn.Module):
    """One MoE layer's experts on the block kernel: :meth:`run_sorted` runs a step's experts over their rows
    (:meth:`expert_mlp`: expert ``e``'s SwiGLU alone).

    Args:
        gate_up: Each expert's gate rows then up rows (``[E, 2 * I, hidden]``): one :class:`StackedBlocks`, or
            two (gate, then up) when the file holds them in different types.
        down: ``[E, hidden, I]``.
        dtype: Activation dtype (the outputs' too).
        max_rows: An expert's steps of more rows run on its dense copy, once made.
        dense_after_rows: An expert's copy is made by the step that brings the rows of its steps past
            ``max_rows`` to this many. Default: :data:`goodserve.models.quant.DENSE_AFTER_ROWS` in bfloat16,
            else 0 (as :class:`goodserve.models.quant.QuantLinear`).

    Raises:
        ValueError: for weights of different expert counts or mismatched shapes, or operands
            :func:`goodserve.models.native.check_blocks` refuses.
    """

    def __init__(self, gate_up: list[StackedBlocks], down: StackedBlocks, dtype: torch.dtype,
                 max_rows: int = EXPERT_MAX_ROWS, dense_after_rows: Optional[int] = None) -> None:
        super().__init__()
        e, hidden, inter = down.shape
        shapes = [p.shape for p in gate_up]
        if any(s[0] != e or s[2] != hidden for s in shapes) or sum(s[1] for s in shapes) != 2 * inter:
            raise ValueError(f"expert gate/up {shapes} do not match down {down.shape}")
        self.num_experts, self.inter, self.dtype, self.max_rows = e, inter, dtype, max_rows
        self.dense_after_rows = (DENSE_AFTER_ROWS if dtype == torch.bfloat16 else 0) if dense_after_rows is None \
            else dense_after_rows
        self.parts = gate_up + [down]  # the last is down
        for i, p in enumerate(self.parts):
            native.check_blocks(p.qtype, p.codes[0], p.scales[0], None if p.mins is None else p.mins[0])
            for name in ("codes", "scales", "mins"):
                self.register_buffer(f"{name}{i}", getattr(p, name))
        self.part_ptrs, self.part_ints = self._part_operands()
        self._rows_past_max = [0] * e  # per expert, rows of its steps past max_rows (until its copy is made)
        self._dense: list[Optional[tuple[nn.Module, nn.Module]]] = [None] * e

    @property
    def nbytes(self) -> int:
        """Bytes of every expert's blocks (the dense copies not counted)."""
        return sum(p.nbytes for p in self.parts)

    def dense_copies(self) -> int:
        """How many experts have their dense copy."""
        return sum(d is not None for d in self._dense)

    def dense(self, e: int) -> tuple[nn.Module, nn.Module]:
        """Expert ``e``'s dense gate/up and down layers (``dtype``, made once from the codes, kept)."""
        if self._dense[e] is None:
            gate_up = torch.cat([dequantize_rows(p.expert(e), self.dtype) for p in self.parts[:-1]])
            self._dense[e] = (dense_linear(gate_up), dense_linear(dequantize_rows(self.parts[-1].expert(e),
                                                                                  self.dtype)))
        return self._dense[e]

    def _part_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``csrc/moe_step.cpp``'s operands: per part (gate/up, a second gate/up part or zeros, down) the
        addresses of its codes, scales and minimums and their byte strides per expert (``[3, 6]`` int64), and
        its kind, offset and output rows (``[3, 3]`` int32)."""
        parts = self.parts[:-1] + [None] * (3 - len(self.parts)) + [self.parts[-1]]
        ptrs, ints = [], []
        for p in parts:
            tensors = [] if p is None else [p.codes, p.scales, p.mins]
            ptrs.append([0] * 6 if p is None else [0 if t is None else t.data_ptr() for t in tensors]
                        + [0 if t is None else t.stride(0) * t.element_size() for t in tensors])
            ints.append([0] * 3 if p is None else [native.BLOCK_KINDS[p.qtype], p.offset, p.shape[1]])
        return torch.tensor(ptrs, dtype=torch.int64), torch.tensor(ints, dtype=torch.int32)

    def takes_in_one_call(self, x: torch.Tensor) -> bool:
        """Whether :meth:`mlp_in_one_call` runs for activations ``x``: at most :data:`ONE_CALL_MAX_ROWS` rows in
        the experts' dtype, the native kernels usable."""
        return 0 < x.shape[0] <= ONE_CALL_MAX_ROWS and x.dtype == self.dtype and native.usable(x)

    def mlp_in_one_call(self, x: torch.Tensor, router: torch.Tensor, top_k: int, renormalise: bool, scaling: float,
                        float32_weighting: bool) -> torch.Tensor:
        """The whole MoE MLP of a small step in one native call (``csrc/moe_step.cpp``, the one-call decode step's
        own): the router, top-k routing as :func:`goodserve.models.moe.route` (float32 softmax, renormalised
        when ``renormalise``, times ``scaling``), each active expert's SwiGLU on the blocks, and each row's k
        outputs weighted and summed in slot order (the weights in float32 when ``float32_weighting``, else in
        ``x``'s dtype).

        Args:
            x: ``[rows, hidden]`` contiguous, :meth:`takes_in_one_call`.
            router: ``[num_experts, hidden]`` in ``x``'s dtype.

        Returns:
            ``[rows, hidden]`` in ``x``'s dtype.

        Raises:
            RuntimeError: if the kernel refuses the call. ValueError: for a router of another shape.
        """
        if router.shape != (self.num_experts, x.shape[1]) or router.dtype != x.dtype or not router.is_contiguous():
            raise ValueError(f"the router must be [{self.num_experts}, {x.shape[1]}] contiguous in {x.dtype}")
        return torch.ops.goodserve.moe_block(x.contiguous(), router, top_k, renormalise, scaling, float32_weighting,
                                             self.part_ptrs, self.part_ints, self.inter)

    def run_sorted(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every expert's SwiGLU over its run of ``rows`` (sorted by expert, ``counts[e]`` rows for expert
        ``e``): ``[n, hidden]`` -> ``[n, hidden]``. The experts with at most ``max_rows`` rows run together,
        one :func:`goodserve.models.native.block_gemv_grouped` call for gate/up (one per part) and one for
        down; an expert with more runs alone through :meth:`expert_mlp` (its dense copy, by the ski-rental
        rule)."""
        groups, alone, start = [], [], 0
        for e, count in enumerate(counts):
            if count:
                (groups if count <= self.max_rows else alone).append((e, start, count))
            start += count
        table = torch.tensor(groups, dtype=torch.int64).view(-1, 3)
        gate_up = [self._grouped(p, rows, table) for p in self.parts[:-1]]
        out = self._grouped(self.parts[-1], native.silu_mul(gate_up[0] if len(gate_up) == 1
                                                            else torch.cat(gate_up, dim=-1)), table)
        for e, first, count in alone:
            out[first:first + count] = self.expert_mlp(e, rows[first:first + count])
        return out

    @staticmethod
    def _grouped(p: StackedBlocks, x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        return native.block_gemv_grouped(x, p.qtype, p.codes, p.scales, p.mins, p.offset, groups, x.dtype)

    def _on_blocks(self, p: StackedBlocks, e: int, x: torch.Tensor) -> torch.Tensor:
        mins = None if p.mins is None else p.mins[e]
        return native.block_gemv(x, p.qtype, p.codes[e], p.scales[e], mins, p.offset, x.dtype)

    def expert_mlp(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """``down_e(silu(gate_e x) * up_e x)``: ``x`` ``[rows, hidden]`` in ``dtype`` -> ``[rows, hidden]``."""
        rows = x.shape[0]
        if rows > self.max_rows:
            if self._dense[e] is None:
                self._rows_past_max[e] += rows
            if self._dense[e] is not None or self._rows_past_max[e] >= self.dense_after_rows:
                gate_up, down = self.dense(e)
                gate, up = gate_up.forward(x).split(self.inter, dim=-1)
                return down.forward(F.silu(gate) * up)
        parts = [self._on_blocks(p, e, x) for p in self.parts[:-1]]
        gate, up = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).split(self.inter, dim=-1)
        return self._on_blocks(self.parts[-1], e, (F.silu(gate) * up).contiguous())
