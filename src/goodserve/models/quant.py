"""Low-bit linear layers for CPU, fed from GGUF blocks as they are in the file.

A GGUF ``Q4_0`` / ``Q4_1`` tensor stores each row in blocks of 32 weights with an fp16 scale ``d`` (and, for
``Q4_1``, an fp16 minimum ``m``) and 4-bit codes ``q`` in 0..15 (llama.cpp ``ggml-quants.c``): ``Q4_0``
``w = d * (q - 8)``, ``Q4_1`` ``w = d * q + m``, ``Q8_0`` ``w = d * q`` with ``q`` in -128..127.

PyTorch's CPU kernel ``aten._weight_int4pack_mm_for_cpu`` computes with ``w = (q - 8) * scale + zero`` per
group of ``group_size`` input features, an affine int4 group: ``Q4_0`` maps to ``scale = d, zero = 0`` and
``Q4_1`` to ``scale = d, zero = m + 8d``, so the codes are used as they are in the file, never re-rounded.
The scales are held in the activation dtype (bfloat16 on the fast path: ``d`` and ``zero`` are rounded to
bfloat16's 8 significant bits, the same relative error as widening the dequantized weight to bfloat16).
``aten._weight_int8pack_mm`` holds one scale per output row, so int8 is a re-quantization (per row,
symmetric, round to nearest) and never exact.

goodserve's block kernel (:func:`goodserve.models.native.block_gemv`, AVX-512 VNNI or AVX2) reads ``Q4_0``,
``Q4_1`` and ``Q8_0`` blocks with their fp16 scales and minimums exactly as the file holds them (and the
K-quants ``Q4_K`` / ``Q5_K`` / ``Q6_K`` and ``Q5_0`` / ``Q5_1``, repacked at load:
:mod:`goodserve.models.kquant`, :mod:`goodserve.models.q5`), and rounds the activations to int16 per block of
32 instead (2^-15 of the block's largest value; the products are exact integers). It is what
``--quantization auto`` runs where it builds, for the tied LM head too.

These kernels are matrix-vector kernels: fast while a step has few rows, far slower than a GEMM for a prefill
chunk. :class:`QuantLinear` runs steps of at most ``max_rows`` rows on the kernel and larger ones on a dense
copy made from the codes (:func:`goodserve.models.decode_plans.dense_copy`) once the larger steps have cost
the kernel about what the copy costs (:data:`DENSE_AFTER_ROWS`): a short one-shot prompt never pays for it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from goodserve.config import QUANTIZATIONS
from goodserve.models import native
from goodserve.models.linear import dense_linear

GROUP_SIZE = 32  # weights per GGUF block (QK4_0 = QK4_1 = QK8_0 = 32)

#: Steps of more rows than this run on the dense copy, once it is made (:data:`DENSE_AFTER_ROWS`): on this
#: class of CPU the int4 kernel is faster than bfloat16 GEMM up to a handful of rows and several times slower
#: at prefill sizes (BENCHMARKS.md). A lone matrix in cache runs faster prepacked than on the int4 kernel from
#: 4 rows, but a decode step streams every weight from memory, and there the int4 kernel's 2.2x fewer bytes
#: keep it ahead at 4 rows (issue 15, run 4: batch 4 at 46 ms with 4 here, 51-54 ms with 2).
DEFAULT_MAX_ROWS = 4

#: ``max_rows`` of block layers in float32 (``auto`` on an AVX2-only CPU): the float32 GEMM ran decode steps slower
#: than the kernel's passes up to this many rows (BENCHMARKS.md, "The block kernel on AVX2").
FLOAT32_BLOCKS_MAX_ROWS = 32

#: Rows of steps past ``max_rows`` an int4 layer in bfloat16 runs on the kernel before it makes its dense
#: copy: the ski-rental rule (Karlin et al., "Competitive snoopy caching", 1988; buy once renting has cost
#: the price), so the rows never cost more than twice the better choice made in hindsight. Measured on this
#: CPU (issue 15, run 6): the dense copies of one layer's four matrices take ~11.5 ms, and the kernel costs
#: ~0.025-0.06 ms more per row than the dense GEMM at 16-128 rows, so the copy pays for itself after
#: ~190-460 rows. The block kernel reads its weight once per 4 rows, as the int4 kernel does, and follows the
#: same rule in either activation dtype. Other kernels and dtypes (not measured; int4 in float32 is ~30x
#: slower) copy at once. A server makes every copy before its first step (:func:`make_dense_copies`).
DENSE_AFTER_ROWS = 256

# Byte layout of one block (ggml-common.h): fp16 d [, fp16 m], then the codes.
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
#: GGUF tensor types :func:`unpack_gguf_blocks` reads.
BLOCK_TYPES = tuple(_BLOCK_BYTES)


@dataclass
class BlockQuantized:
    """A weight in GGUF block form, unpacked: row ``n``, group ``g`` holds ``scale[n, g] * (q - offset) + min``.

    Attributes:
        qtype: ``"Q4_0"``, ``"Q4_1"`` or ``"Q8_0"``.
        q: ``[out_features, in_features]`` codes, ``uint8`` 0..15 for Q4, ``int8`` for Q8.
        scales: ``[out_features, in_features // 32]`` float32 (the file's fp16 ``d``).
        mins: ``[out_features, in_features // 32]`` float32 (Q4_1's ``m``), or ``None``.
    """

    qtype: str
    q: torch.Tensor
    scales: torch.Tensor
    mins: Optional[torch.Tensor] = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """``[out, in]`` float32 weights computed as llama.cpp / ``gguf.quants`` do (``d * q + m``)."""
        n, k = self.q.shape
        q = self.q.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
        if self.qtype == "Q4_0":
            q = q - 8
        w = self.scales[..., None] * q
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.view(n, k)

    def permute_rows(self, index: torch.Tensor) -> "BlockQuantized":
        """The same weight with its rows reordered (``index``: ``[out_features]`` new -> old row)."""
        mins = None if self.mins is None else self.mins[index]
        return type(self)(self.qtype, self.q[index], self.scales[index], mins)

    def split_rows(self, sizes: list[int]) -> list["BlockQuantized"]:
        """The weight cut along its output rows into parts of ``sizes`` rows (views; the inverse of :meth:`cat`).

        Raises:
            ValueError: when ``sizes`` do not add up to the rows.
        """
        if sum(sizes) != self.q.shape[0]:
            raise ValueError(f"cannot split {self.q.shape[0]} rows into {sizes}")
        mins = [None] * len(sizes) if self.mins is None else self.mins.split(sizes)
        return [type(self)(self.qtype, q, s, m)
                for q, s, m in zip(self.q.split(sizes), self.scales.split(sizes), mins)]

    @staticmethod
    def cat(parts: list["BlockQuantized"]) -> "BlockQuantized":
        """Stack weights of one type along the output rows (q/k/v or gate/up fusion).

        Raises:
            ValueError: when the parts are of different types.
        """
        kinds = {p.qtype for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse weights of different quantization types {sorted(kinds)}")
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
        return type(parts[0])(parts[0].qtype, torch.cat([p.q for p in parts]),
                              torch.cat([p.scales for p in parts]), mins)


def dequantize_rows(weight: BlockQuantized, dtype: torch.dtype, rows: int = 4096) -> torch.Tensor:
    """``weight.dequantize().to(dtype)``, a few thousand rows at a time.

    The same values as dequantizing the whole matrix (and as ``gguf.quants.dequantize``, whose float32
    arithmetic it repeats), without float32 copies of the whole matrix: for the default model's 49,152 x 576
    Q8_0 embedding, gguf's dequantization held ~230 MB of them at the peak of loading.
    """
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype)
    sizes = [min(rows, n - start) for start in range(0, n, rows)]
    for start, part in zip(range(0, n, rows), weight.split_rows(sizes)):
        out[start:start + part.shape[0]] = part.dequantize()
    return out


def file_blocks(data: np.ndarray, qtype: str, shape: tuple[int, int], block_bytes: dict[str, int],
                block_len: int, family: str, align: Optional[int] = None) -> np.ndarray:
    """A GGUF tensor's raw bytes cut into its blocks: ``[out_features, in_features // block_len, bytes per
    block]`` uint8, for ``qtype`` among ``block_bytes`` (bytes per block of each type of the ``family``),
    ``shape`` ``(out_features, in_features)`` and ``in_features`` a multiple of ``align`` (default
    ``block_len``, the weights per block). Every block family's unpacker starts here.

    Raises:
        ValueError: for a type outside the family, or a byte count that does not match ``shape``.
    """
    if qtype not in block_bytes:
        raise ValueError(f"no {family} layout for GGUF type {qtype}")
    n, k = shape
    align = align or block_len
    if k % align or data.size != n * (k // block_len) * block_bytes[qtype]:
        raise ValueError(f"GGUF {qtype} tensor of {data.size} bytes does not hold a [{n}, {k}] weight"
                         + (f" (in_features a multiple of {align})" if align != block_len else ""))
    return np.ascontiguousarray(data).reshape(n, k // block_len, block_bytes[qtype])


def unpack_gguf_blocks(data: np.ndarray, qtype: str, shape: tuple[int, int]) -> BlockQuantized:
    """Split a GGUF tensor's raw bytes into codes, scales and minimums.

    Args:
        data: ``[out_features, bytes_per_row]`` uint8 as the GGUF reader maps it.
        qtype: ``"Q4_0"``, ``"Q4_1"`` or ``"Q8_0"``.
        shape: ``(out_features, in_features)``.

    Returns:
        The :class:`BlockQuantized` weight (codes in the file's order: within a Q4 block, byte ``j`` holds
        weight ``j`` in its low nibble and weight ``j + 16`` in its high nibble).

    Raises:
        ValueError: for another type, or a byte count that does not match ``shape``.
    """
    blocks = file_blocks(data, qtype, shape, _BLOCK_BYTES, GROUP_SIZE, "block")
    n, k = shape
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if qtype == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k))
        return BlockQuantized(qtype, q, scales)
    mins = None
    if qtype == "Q4_1":
        mins = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    codes = torch.from_numpy(blocks[..., -16:].copy())  # [n, groups, 16]
    q = torch.cat([codes & 15, codes >> 4], dim=-1).reshape(n, k)
    return BlockQuantized(qtype, q, scales, mins)


def quantize_int4(weight: torch.Tensor) -> BlockQuantized:
    """Round-to-nearest asymmetric int4 in groups of 32 (a Q4_1-like block) for weights the file holds dense.

    Args:
        weight: ``[out_features, in_features]`` with ``in_features % 32 == 0``.
    """
    n, k = weight.shape
    w = weight.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = w.amin(-1), w.amax(-1)
    scales = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((w - lo[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
    return BlockQuantized("Q4_1", q, scales, lo)


def pack_int4(weight: BlockQuantized, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 kernel's operands for a Q4_0/Q4_1 weight.

    Returns:
        ``(packed, scales_and_zeros)``: ``[out, in // 2]`` uint8 and ``[in // 32, out, 2]`` in ``dtype``
        (``scale = d``; ``zero = m + 8d`` for Q4_1, ``0`` for Q4_0).

    Raises:
        ValueError: for another type, or ``out_features`` not a multiple of 64 (the kernel's largest row
            tile).
    """
    if weight.qtype not in ("Q4_0", "Q4_1"):
        raise ValueError(f"{weight.qtype} weights do not map to the int4 kernel")
    n, _ = weight.shape
    if n % 64:
        raise ValueError(f"int4 packing needs out_features to be a multiple of 64, got {n}")
    zeros = torch.zeros_like(weight.scales) if weight.mins is None else weight.mins + 8 * weight.scales
    packed = pack_int4_codes(weight.q)
    scales_and_zeros = torch.stack([weight.scales.t(), zeros.t()], dim=-1).contiguous().to(dtype)
    return packed, scales_and_zeros


@functools.cache
def int4_tile_rows() -> int:
    """Output rows per tile of the CPU int4 kernel's packed layout: 64 where PyTorch's kernel was built for
    AVX-512, 32 on AVX2 (``BLOCK_N`` of ``aten/src/ATen/native/cpu/int4mm_kernel.cpp``). Read once from the
    kernel's own packing of a probe, so the layout can never disagree with the kernel that reads it.

    Raises:
        RuntimeError: if the kernel packs in none of the known layouts.
    """
    q = torch.arange(128 * 64, dtype=torch.int64).remainder_(13).to(torch.uint8).view(128, 64)
    ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
    for rows in (64, 32, 16):
        if torch.equal(_pack_tiles(q, rows), ref):
            return rows
    raise RuntimeError("PyTorch's CPU int4 kernel packs its weights in an unknown layout")


def _pack_tiles(q: torch.Tensor, rows: int) -> torch.Tensor:
    """Rows ``r`` and ``r + rows/2`` of each tile of ``rows`` output rows in one byte, per input feature."""
    n, k = q.shape
    tiles = q.view(n // rows, 2, rows // 2, k)
    return (tiles[:, 0] | (tiles[:, 1] << 4)).transpose(1, 2).contiguous().view(n, k // 2)


def pack_int4_codes(q: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` uint8 codes 0..15 in the CPU int4 kernel's packed layout, ``[out, in // 2]`` uint8.

    The same bytes as ``aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)`` (``tests/test_quant.py``), made
    with two uint8 operations instead of through an int32 copy of every weight: per tile of
    :func:`int4_tile_rows` output rows ``T`` and per input feature, rows ``r`` and ``r + T/2`` of the tile go
    in the low and high nibble of one byte.
    """
    return _pack_tiles(q, int4_tile_rows())


def unpack_int4(packed: torch.Tensor, scales_and_zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dense ``[out, in]`` weight of :func:`pack_int4`'s operands: ``(q - 8) * scale + zero`` in float32.

    The CPU packing stores, per tile of ``T`` output rows (:func:`int4_tile_rows`) and per input feature, rows
    ``r`` and ``r + T/2`` of the tile in the low and high nibble of one byte (``[out / T, in, T/2]``);
    ``tests/test_quant.py`` checks the round trip against the kernel.
    """
    n, k = packed.shape[0], packed.shape[1] * 2
    rows = int4_tile_rows()
    tiles = packed.view(n // rows, k, rows // 2)
    q = torch.cat([tiles & 15, tiles >> 4], dim=-1).permute(0, 2, 1).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    sz = scales_and_zeros.float()  # [groups, n, 2]
    # In place on one float32 buffer: the same operations as ``(q - 8) * scale + zero``, without three more
    # weight-sized temporaries (a server makes every dense copy at start).
    w = q.float().sub_(8).mul_(sz[..., 0].t()[..., None]).add_(sz[..., 1].t()[..., None])
    return w.view(n, k).to(dtype)


#: Code offset of each type in :func:`pack_blocks`' layout (the weight is ``d * (u - offset) + m``).
_BLOCK_OFFSETS = {"Q4_0": 8, "Q4_1": 0, "Q8_0": 128}
# The same for the types held in the kernel's layout from the load: the K-quants
# (``goodserve.models.kquant.KQUANT_OFFSETS``) and Q5_0 / Q5_1 (``goodserve.models.q5.Q5_OFFSETS``; the tests check).
_K_OFFSETS = {"Q4_K": 0, "Q5_K": 0, "Q6_K": 32}
_PACKED_OFFSETS = {**_K_OFFSETS, "Q5_0": 16, "Q5_1": 0}


def pack_blocks(weight: BlockQuantized) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]:
    """The native block kernel's operands (:func:`goodserve.models.native.block_gemv`): the file's blocks
    without re-rounding anything.

    A K-quant weight (:class:`goodserve.models.kquant.KQuantized`) or a Q5_0 / Q5_1 one
    (:class:`goodserve.models.q5.Q5Quantized`) is already in the kernel's layout: its ``(q, scales, mins)``
    (``mins`` ``None`` for Q5_0) and offset 0 (Q4_K, Q5_K, Q5_1), 16 (Q5_0) or 32 (Q6_K).

    Returns:
        ``(codes, scales, mins, offset)``: Q4: ``[out, in // 2]`` uint8, byte ``j`` of each block holding
        weights ``j`` and ``j + 16`` in its low and high nibble (the file's code bytes); Q8_0: ``[out, in]``
        uint8 ``q + 128``. ``scales`` and ``mins`` (Q4_1, else ``None``): ``[out, in // 32]`` float16, the
        file's values. ``offset``: 8, 0 and 128 for Q4_0, Q4_1 and Q8_0.
    """
    if weight.qtype in _PACKED_OFFSETS:
        mins = None if weight.mins is None else weight.mins.contiguous()
        return weight.q.contiguous(), weight.scales.contiguous(), mins, _PACKED_OFFSETS[weight.qtype]
    n, k = weight.shape
    if weight.qtype == "Q8_0":
        codes = (weight.q.view(torch.uint8) ^ 0x80).contiguous()  # two's complement q + 128
    else:
        q = weight.q.view(n, k // GROUP_SIZE, GROUP_SIZE)
        codes = (q[..., :16] | (q[..., 16:] << 4)).contiguous().view(n, k // 2)
    mins = None if weight.mins is None else weight.mins.to(torch.float16).contiguous()
    return codes, weight.scales.to(torch.float16).contiguous(), mins, _BLOCK_OFFSETS[weight.qtype]


def unpack_blocks(qtype: str, codes: torch.Tensor, scales: torch.Tensor,
                  mins: Optional[torch.Tensor]) -> BlockQuantized:
    """The :class:`BlockQuantized` weight of :func:`pack_blocks`' operands."""
    if qtype in _K_OFFSETS:
        from goodserve.models.kquant import KQuantized  # kquant builds on this module

        return KQuantized(qtype, codes, scales, mins)
    if qtype in _PACKED_OFFSETS:
        from goodserve.models.q5 import Q5Quantized  # q5 builds on this module

        return Q5Quantized(qtype, codes, scales, mins)
    if qtype == "Q8_0":
        q = (codes ^ 0x80).view(torch.int8)
    else:
        n, half = codes.shape
        c = codes.view(n, half // 16, 16)
        q = torch.cat([c & 15, c >> 4], dim=-1).view(n, half * 2)
    return BlockQuantized(qtype, q, scales.float(), None if mins is None else mins.float())


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 (round to nearest) for ``aten._weight_int8pack_mm``.

    Returns:
        ``(q, scales)``: ``[out, in]`` int8 and ``[out]`` in ``dtype``.
    """
    w = weight.float()
    scales = (w.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales.to(dtype)


class QuantLinear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` held as int4 groups, int8 rows or the file's blocks.

    Args:
        kind: ``"int4"`` or ``"int8"`` (PyTorch's kernels), or ``"blocks"`` (the native block kernel).
        weight: For int4, a Q4_0/Q4_1 :class:`BlockQuantized`; for blocks, a Q4_0/Q4_1/Q8_0 one, a K-quant
            (:class:`goodserve.models.kquant.KQuantized`) or a Q5_0/Q5_1 one (:class:`goodserve.models.q5.Q5Quantized`);
            for int8, a dense ``[out, in]`` tensor.
        dtype: Activation dtype (the kernels are fast in bfloat16).
        bias: ``[out]`` or ``None``.
        max_rows: Steps of more rows run on a dense ``dtype`` copy of the weight, once it is made.
        dense_after_rows: The copy is made by the step that brings the rows of such steps to this many; the
            steps before it run on the kernel. Default: :data:`DENSE_AFTER_ROWS` for blocks, and for int4 in
            bfloat16; else 0.

    Raises:
        ValueError: see :func:`pack_int4` and :func:`goodserve.models.native.check_blocks`; for another kind.
    """

    def __init__(self, kind: str, weight, dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
                 max_rows: int = DEFAULT_MAX_ROWS, dense_after_rows: Optional[int] = None) -> None:
        super().__init__()
        self.kind, self.dtype, self.max_rows = kind, dtype, max_rows
        if dense_after_rows is None:
            waits = kind == "blocks" or (kind == "int4" and dtype == torch.bfloat16)
            dense_after_rows = DENSE_AFTER_ROWS if waits else 0
        self.dense_after_rows = dense_after_rows
        self._rows_past_max = 0  # rows of steps past max_rows so far (until the dense copy is made)
        self.out_features, self.in_features = weight.shape
        self.qtype, self.offset, mins = None, 0, None
        if kind == "int4":
            packed, extra = pack_int4(weight, dtype)
        elif kind == "int8":
            packed, extra = quantize_int8(weight, dtype)
        elif kind == "blocks":
            self.qtype = weight.qtype
            packed, extra, mins, self.offset = pack_blocks(weight)
            native.check_blocks(self.qtype, packed, extra, mins)
        else:
            raise ValueError(f"unknown kernel {kind!r}; expected 'int4', 'int8' or 'blocks'")
        self.register_buffer("packed", packed)
        # int4: scales_and_zeros [groups, out, 2]; int8: scales [out]; blocks: the file's scales [out, groups]
        self.register_buffer("extra", extra)
        self.register_buffer("mins", mins)  # blocks of Q4_1: the file's minimums [out, groups]
        self.bias = None if bias is None else bias.to(dtype)
        self._dense: Optional[nn.Module] = None

    @property
    def nbytes(self) -> int:
        """Bytes a kernel call reads for the weight (codes + scales)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.extra, self.mins) if t is not None)

    def dense_weight(self) -> torch.Tensor:
        """``[out, in]`` in the activation dtype, made from the codes."""
        if self.kind == "int4":
            return unpack_int4(self.packed, self.extra, self.dtype)
        if self.kind == "blocks":
            return dequantize_rows(unpack_blocks(self.qtype, self.packed, self.extra, self.mins), self.dtype)
        return (self.packed.float() * self.extra.float()[:, None]).to(self.dtype)

    def dense(self) -> nn.Module:
        """The dense layer large steps run on (made once, kept; see ``dense_after_rows``)."""
        if self._dense is None:
            from goodserve.models.decode_plans import dense_copy  # it imports this module
            weight = self.dense_weight()
            # Not registered as a submodule: it is a cache of this layer's weight, not more weights.
            object.__setattr__(self, "_dense", dense_copy(weight, self.bias) if self.kind == "blocks"
                               else dense_linear(weight, self.bias))
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[rows, in_features]`` in the activation dtype -> ``[rows, out_features]``."""
        rows = x.shape[0]
        if rows > self.max_rows:
            if self._dense is None:
                self._rows_past_max += rows
            if self._dense is not None or self._rows_past_max >= self.dense_after_rows:
                return self.dense().forward(x)
        if self.kind == "blocks":
            y = native.block_gemv(x, self.qtype, self.packed, self.extra, self.mins, self.offset, x.dtype)
        elif self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.extra)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, self.packed, self.extra)
        return y if self.bias is None else y + self.bias


def make_dense_copies(model: nn.Module) -> int:
    """Make the dense copy of every :class:`QuantLinear` in ``model`` now (a server, before its first step:
    made lazily, ~0.3 s of copies for the default model would land in one served step, and a request's
    greedy tokens would depend on whether earlier traffic had already made them).

    Returns:
        The number of layers whose copy was made by this call.
    """
    made = 0
    for module in model.modules():
        if isinstance(module, QuantLinear) and module._dense is None:
            module.dense()
            made += 1
    return made


def make_linear(weight, bias: Optional[torch.Tensor], dtype: torch.dtype, quantization: str) -> nn.Module:
    """The linear layer that runs ``weight`` under ``--quantization`` (rules in :data:`QUANTIZATIONS`).

    ``auto`` keeps each weight as the file holds it where a kernel exists: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and
    Q4_K/Q5_K/Q6_K blocks on the native block kernel where it builds, in bfloat16 or (on an AVX2-only CPU)
    float32 (:func:`runs_on_blocks`), else Q4_0/Q4_1 on PyTorch's int4 kernel in bfloat16; every other weight,
    and every weight in float32 elsewhere (the precision mode; PyTorch 2.13's int4 kernel has no fast float32
    path on CPU: ~30x slower), is dequantized to ``dtype``.

    Args:
        weight: ``[out, in]`` tensor or :class:`BlockQuantized`.
        bias: ``[out]`` or ``None``.
        dtype: Activation dtype.
        quantization: One of :data:`QUANTIZATIONS`.

    Returns:
        A dense layer of :func:`goodserve.models.linear.dense_linear` (``dtype``) or a :class:`QuantLinear`.

    Raises:
        ValueError: on an unknown ``quantization``, or ``int4`` for a weight the kernel cannot hold.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    q4 = isinstance(weight, BlockQuantized) and weight.qtype in ("Q4_0", "Q4_1")
    if quantization == "auto" and runs_on_blocks(weight, dtype):
        return QuantLinear("blocks", weight, dtype, bias,
                           max_rows=FLOAT32_BLOCKS_MAX_ROWS if dtype == torch.float32 else DEFAULT_MAX_ROWS)
    if quantization == "auto":
        quantization = "int4" if q4 and dtype == torch.bfloat16 and weight.shape[0] % 64 == 0 else "none"
    if quantization == "int4":
        return QuantLinear("int4", weight if q4 else quantize_int4(_dense(weight)), dtype, bias)
    if quantization == "int8":
        return QuantLinear("int8", _dense(weight), dtype, bias)
    return dense_linear(_dense(weight).to(dtype), bias)


def runs_on_blocks(weight, dtype: torch.dtype) -> bool:
    """Whether ``--quantization auto`` runs ``weight`` on the native block kernel: the file's blocks, activations
    of a dtype :func:`goodserve.models.native.blocks_run_in` allows, and a shape the kernel takes."""
    return isinstance(weight, BlockQuantized) and native.block_gemv_fits(*weight.shape) and native.blocks_run_in(dtype)


def _dense(weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, BlockQuantized) else weight
