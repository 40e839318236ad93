"""GGUF K-quant weights (``Q4_K``, ``Q5_K``, ``Q6_K``) kept as blocks for the native block kernel.

A K-quant tensor stores each row in super-blocks of 256 weights (llama.cpp ``ggml-common.h``:
``block_q4_K``, ``block_q5_K``, ``block_q6_K``; dequantized as ``ggml-quants.c``'s ``dequantize_row_q*_K``
and ``gguf.quants`` do, in float32):

* ``Q4_K`` (144 bytes, 4.5 bits per weight): fp16 ``d`` and ``dmin``, 12 bytes of 6-bit scales ``sc`` and
  minimums ``m`` for the 8 sub-blocks of 32 (``get_scale_min_k4``), 128 bytes of 4-bit codes ``q``:
  ``w = (d * sc) * q - (dmin * m)``.
* ``Q5_K`` (176 bytes, 5.5 bits): as ``Q4_K`` plus ``qh[32]``, the codes' fifth bit; ``q`` in 0..31.
* ``Q6_K`` (210 bytes, 6.5625 bits): ``ql[128]`` (low 4 bits), ``qh[64]`` (high 2 bits), 16 int8 scales, one
  per 16 weights, and fp16 ``d``: ``w = (d * sc) * (q - 32)``.

:class:`KQuantized` holds them in the layout :func:`goodserve.models.native.block_gemv` reads (stated in
``csrc/block_gemv.cpp``), repacked from the file's bytes once at load, nothing re-rounded: per pair of
32-blocks the Q4 nibble bytes (byte ``j`` of a block: weight ``j`` low, ``j + 16`` high), then one (Q5_K)
or two (Q6_K) 64-bit planes of the codes' bits 4 and 5; the super-blocks' fp16 scales; the sub-blocks' 8-bit
scales (and minimums). In memory: 4.625, 5.625 and 6.5625 bits per weight (the file's 4.5, 5.5 and 6.5625:
the 6-bit sub-block scales and minimums of Q4_K / Q5_K are held one per byte).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from goodserve.models.quant import BlockQuantized, file_blocks

QK_K = 256  # weights per super-block
#: GGUF K-quant types :func:`unpack_gguf_kquant` reads.
KQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")
_FILE_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes of one super-block in the file
#: Code bits above the low nibble, held as bit planes.
HIGH_BITS = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}
#: Subtracted from each code (the weight is ``scale * (q - offset) - min``).
KQUANT_OFFSETS = {"Q4_K": 0, "Q5_K": 0, "Q6_K": 32}


@dataclass
class KQuantized(BlockQuantized):
    """A K-quant weight in the block kernel's layout; rows permute, split and fuse as :class:`BlockQuantized`'s.

    Attributes (``N`` output rows, ``K`` input features, a multiple of 256):
        qtype: ``"Q4_K"``, ``"Q5_K"`` or ``"Q6_K"``.
        q: ``[N, K * (4 + HIGH_BITS) / 8]`` uint8 packed codes (module docstring).
        scales: Q4_K / Q5_K: ``[N, K / 256 * 2]`` float16, each super-block's ``d`` then ``dmin``; Q6_K:
            ``[N, K / 256]`` float16 ``d``.
        mins: Q4_K / Q5_K: ``[N, K / 256 * 16]`` uint8, each super-block's 8 sub-block scales then its 8
            minimums (0..63); Q6_K: ``[N, K / 16]`` int8 scales.
    """

    @property
    def shape(self) -> tuple[int, int]:
        per_super = 1 if self.qtype == "Q6_K" else 2
        return self.q.shape[0], self.scales.shape[1] // per_super * QK_K

    def codes(self) -> torch.Tensor:
        """``[N, K]`` uint8 codes ``q`` (0..15, 0..31 or 0..63), unpacked from :attr:`q`."""
        n, k = self.shape
        return unpack_codes(self.q, k, HIGH_BITS[self.qtype])

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` float32 weights, bit for bit ``gguf.quants.dequantize``'s (the same float32 operations)."""
        n, k = self.shape
        sb = k // QK_K
        if self.qtype == "Q6_K":
            dsc = self.scales.float()[..., None] * self.mins.view(n, sb, 16).float()  # d * sc per 16 weights
            q = (self.codes().to(torch.int16) - 32).float().view(n, sb, 16, 16)
            return (dsc[..., None] * q).view(n, k)
        d = self.scales.view(n, sb, 2).float()
        sub = self.mins.view(n, sb, 2, 8).float()
        dsc, dm = d[..., 0:1] * sub[:, :, 0], d[..., 1:2] * sub[:, :, 1]  # [n, sb, 8] each
        q = self.codes().float().view(n, sb, 8, 32)
        return (dsc[..., None] * q - dm[..., None]).view(n, k)


def pack_codes(q: np.ndarray, high_bits: int) -> np.ndarray:
    """``[N, K]`` uint8 codes -> the kernel's packed ``[N, K * (4 + high_bits) / 8]`` uint8 (module docstring).

    Per pair of 32-blocks: 32 nibble bytes (byte ``j`` of each block: weight ``j`` low, ``j + 16`` high),
    then per bit ``4 + t`` (``t < high_bits``) 8 bytes, a little-endian 64-bit plane whose bit ``i`` is that
    bit of the pair's weight ``i`` in the order block ``2p``'s 0-15, block ``2p + 1``'s 0-15, block ``2p``'s
    16-31, block ``2p + 1``'s 16-31 (the order of the int16 lanes the kernel widens the nibbles to).
    """
    n, k = q.shape
    pairs = q.reshape(n, k // 64, 2, 2, 16)  # pair, block, half, j
    nibbles = (pairs[:, :, :, 0] & 15) | ((pairs[:, :, :, 1] & 15) << 4)  # [n, P, 2, 16]
    parts = [nibbles.reshape(n, k // 64, 32)]
    lanes = pairs.transpose(0, 1, 3, 2, 4).reshape(n, k // 64, 64)  # half, block, j
    for t in range(high_bits):
        parts.append(np.packbits((lanes >> (4 + t)) & 1, axis=-1, bitorder="little"))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(n, -1))


def unpack_codes(packed: torch.Tensor, k: int, high_bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes`: ``[N, K]`` uint8 codes."""
    n = packed.shape[0]
    pairs = packed.view(n, k // 64, 32 + 8 * high_bits)
    nibbles = pairs[..., :32].reshape(n, k // 64, 2, 16)
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # [n, P, 2 blocks, 32]
    shifts = torch.arange(8, dtype=torch.uint8)
    for t in range(high_bits):
        plane = pairs[..., 32 + 8 * t:40 + 8 * t]
        bits = ((plane[..., None] >> shifts) & 1).reshape(n, k // 64, 2, 2, 16)  # half, block, j
        q |= bits.transpose(2, 3).reshape(n, k // 64, 2, 32) << (4 + t)
    return q.reshape(n, k)


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and minimums of a Q4_K / Q5_K super-block from its 12 bytes (``ggml-quants.c``
    ``get_scale_min_k4``): ``[..., 12]`` uint8 -> two ``[..., 8]`` uint8."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _fp16(raw: np.ndarray) -> np.ndarray:
    """``[..., 2]`` uint8 little-endian half floats -> ``[...]`` float16."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def unpack_gguf_kquant(data: np.ndarray, qtype: str, shape: tuple[int, int]) -> KQuantized:
    """A GGUF K-quant tensor's raw bytes in the kernel's layout.

    Args:
        data: ``[out_features, bytes_per_row]`` uint8 (or the flat bytes) as the GGUF reader maps it.
        qtype: ``"Q4_K"``, ``"Q5_K"`` or ``"Q6_K"``.
        shape: ``(out_features, in_features)``, ``in_features`` a multiple of 256.

    Returns:
        The :class:`KQuantized` weight, whose :meth:`~KQuantized.dequantize` equals
        ``gguf.quants.dequantize(data, qtype)`` exactly.

    Raises:
        ValueError: for another type, or a byte count that does not match ``shape``.
    """
    blocks = file_blocks(data, qtype, shape, _FILE_BYTES, QK_K, "K-quant")
    n, k = shape
    sb = k // QK_K
    if qtype == "Q6_K":  # ql[128], qh[64], scales[16], d
        ql = (blocks[..., None, 0:128].reshape(n, sb, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 15
        qh = (blocks[..., None, 128:192].reshape(n, sb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        q = ql.reshape(n, k) | (qh.reshape(n, k) << 4)
        scales = _fp16(blocks[..., 208:210])
        sub = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(n, sb * 16)
    else:  # d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
        qs = blocks[..., -128:].reshape(n, sb, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        q = (qs & 15).reshape(n, k)
        if qtype == "Q5_K":
            qh = (blocks[..., 16:48].reshape(n, sb, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            q = q | (qh.reshape(n, k) << 4)
        sc, mn = _scale_min_k4(blocks[..., 4:16])
        scales = np.stack([_fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])], axis=-1).reshape(n, sb * 2)
        sub = np.concatenate([sc, mn], axis=-1).reshape(n, sb * 16)
    packed = pack_codes(q.astype(np.uint8), HIGH_BITS[qtype])
    return KQuantized(qtype, torch.from_numpy(packed), torch.from_numpy(np.ascontiguousarray(scales)),
                      torch.from_numpy(np.ascontiguousarray(sub)))


class PartsLinear(nn.Module):
    """``y = [x W_1^T, ..., x W_p^T]``: a fused projection (q/k/v, gate/up) whose parts the file holds in
    different block types, each part on its own layer. llama.cpp's Q4_K_M gives ``attn_v`` (and
    ``ffn_down``) Q6_K in about half the layers beside Q4_K ``attn_q`` / ``attn_k``; fused into one dense
    matrix, those layers' q/k/v would stream bfloat16 (16 bits per weight) instead of 4.6-6.6.

    Args:
        parts: The parts' layers (``[rows, in] -> [rows, out_i]``), in output order.
    """

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[rows, in_features]`` -> ``[rows, sum of the parts' out_features]``."""
        return torch.cat([part(x) for part in self.parts], dim=-1)
