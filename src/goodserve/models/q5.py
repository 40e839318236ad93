"""GGUF ``Q5_0`` and ``Q5_1`` weights kept as blocks for the native block kernel.

A ``Q5_0`` / ``Q5_1`` tensor stores each row in blocks of 32 weights (llama.cpp ``ggml-common.h``:
``block_q5_0``, ``block_q5_1``; dequantized as ``ggml-quants.c``'s ``dequantize_row_q5_*`` and
``gguf.quants`` do, in float32):

* ``Q5_0`` (22 bytes, 5.5 bits per weight): fp16 ``d``, ``qh[4]`` (bit ``j`` of the little-endian uint32:
  the fifth bit of weight ``j``), ``qs[16]`` (byte ``j``: weight ``j`` in the low nibble, ``j + 16`` in the
  high one): ``w = d * (q - 16)``, ``q`` in 0..31.
* ``Q5_1`` (24 bytes, 6 bits): fp16 ``d`` and ``m``, then ``qh[4]`` and ``qs[16]`` as ``Q5_0``'s:
  ``w = d * q + m``.

llama.cpp's quantizer falls back to them for rows whose length is not a multiple of 256 (``Q4_K_M`` of
SmolLM2-135M, hidden size 576: ``Q5_0`` for every q/k/v/o and gate/up projection).

:class:`Q5Quantized` holds them in the layout :func:`goodserve.models.native.block_gemv` reads (stated in
``csrc/block_gemv.cpp``), repacked from the file's bytes once at load, nothing re-rounded: the codes as
``Q5_K``'s (:func:`goodserve.models.kquant.pack_codes`: per pair of 32-blocks their 32 nibble bytes, then
one 64-bit plane of the fifth bits), the scales and minimums as ``Q4_0`` / ``Q4_1``'s (one fp16 per block).
In memory: 5.5 and 6 bits per weight, the file's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from goodserve.models.kquant import pack_codes, unpack_codes
from goodserve.models.quant import GROUP_SIZE, BlockQuantized, file_blocks

_FILE_BYTES = {"Q5_0": 22, "Q5_1": 24}  # bytes of one block in the file
#: GGUF types :func:`unpack_gguf_q5` reads.
Q5_TYPES = tuple(_FILE_BYTES)
#: Subtracted from each code (the weight is ``d * (q - offset) + m``).
Q5_OFFSETS = {"Q5_0": 16, "Q5_1": 0}


@dataclass
class Q5Quantized(BlockQuantized):
    """A ``Q5_0`` / ``Q5_1`` weight in the block kernel's layout; rows permute, split and fuse as
    :class:`BlockQuantized`'s.

    Attributes (``N`` output rows, ``K`` input features, a multiple of 64):
        qtype: ``"Q5_0"`` or ``"Q5_1"``.
        q: ``[N, K * 5 / 8]`` uint8 packed codes (module docstring).
        scales: ``[N, K / 32]`` float16, each block's ``d``.
        mins: ``[N, K / 32]`` float16, each block's ``m`` (``Q5_1``), or ``None`` (``Q5_0``).
    """

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.scales.shape[1] * GROUP_SIZE

    def codes(self) -> torch.Tensor:
        """``[N, K]`` uint8 codes ``q`` (0..31), unpacked from :attr:`q`."""
        return unpack_codes(self.q, self.shape[1], 1)

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` float32 weights, bit for bit ``gguf.quants.dequantize``'s (the same float32 operations)."""
        n, k = self.shape
        q = self.codes().view(n, k // GROUP_SIZE, GROUP_SIZE)
        if self.qtype == "Q5_0":
            w = self.scales.float()[..., None] * (q.to(torch.int16) - 16).float()
        else:
            w = self.scales.float()[..., None] * q.float() + self.mins.float()[..., None]
        return w.view(n, k)


def unpack_gguf_q5(data: np.ndarray, qtype: str, shape: tuple[int, int]) -> Q5Quantized:
    """A GGUF ``Q5_0`` / ``Q5_1`` tensor's raw bytes in the kernel's layout.

    Args:
        data: ``[out_features, bytes_per_row]`` uint8 (or the flat bytes) as the GGUF reader maps it.
        qtype: ``"Q5_0"`` or ``"Q5_1"``.
        shape: ``(out_features, in_features)``, ``in_features`` a multiple of 64 (the kernel's pairs of blocks).

    Returns:
        The :class:`Q5Quantized` weight, whose :meth:`~Q5Quantized.dequantize` equals
        ``gguf.quants.dequantize(data, qtype)`` exactly.

    Raises:
        ValueError: for another type, or a byte count that does not match ``shape``, or ``in_features`` not
            a multiple of 64.
    """
    blocks = file_blocks(data, qtype, shape, _FILE_BYTES, GROUP_SIZE, "Q5", align=64)
    n, k = shape
    nb = k // GROUP_SIZE
    head = 2 if qtype == "Q5_0" else 4  # d [, m]
    qh = blocks[..., head:head + 4].reshape(n, nb, 4, 1) >> np.arange(8, dtype=np.uint8)  # [n, nb, byte, bit]
    qs = blocks[..., head + 4:].reshape(n, nb, 1, 16) >> np.array([0, 4], np.uint8)[:, None]  # [n, nb, 2, 16]
    q = (qs & 15).reshape(n, k) | ((qh & 1).reshape(n, k) << 4)
    scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    mins = None
    if qtype == "Q5_1":
        mins = torch.from_numpy(np.ascontiguousarray(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]))
    return Q5Quantized(qtype, torch.from_numpy(pack_codes(q.astype(np.uint8), 1)),
                       torch.from_numpy(np.ascontiguousarray(scales)), mins)
