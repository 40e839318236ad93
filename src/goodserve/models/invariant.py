"""Batch-invariant linear layers: a row's output depends on that row alone.

A BLAS library chooses its blocking, small-M paths and its split of the reduced dimension across threads
from the shape of the call, so the same token's projections come out a few bfloat16 steps apart when it is
computed alone, beside 63 other decodes, or inside a prefill chunk — and a sampled token can flip
("Defeating Nondeterminism in LLM Inference", Thinking Machines Lab, 2025; vLLM ``VLLM_BATCH_INVARIANT``).
:class:`InvariantLinear` runs every step size on one kernel whose reduction order per output is fixed:

* **native** (``csrc/invariant_gemm.cpp``, CPU with AVX512-BF16, on AMX where the OS grants it): the weight
  packed once into B tiles of 32 x 16, K summed tile by tile in order, only N split across threads; float32
  activations run an AVX-512 FMA kernel that sums K in order. A GGUF's Q4_0 / Q4_1 / Q8_0 blocks are
  dequantized into the packed bfloat16 weight (the values of their dense copy).
* **torch** (no native kernel, or a shape it does not take): the GEMM library on row tiles of a fixed
  shape (:data:`TILE_ROWS` rows, the last one zero-padded). For one shape the library always runs the same
  code, and a row's result does not depend on its neighbours or its position in the tile (checked by
  ``tests/test_batch_invariant.py`` on the library installed).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from goodserve.models import native
from goodserve.models.linear import dense_linear
from goodserve.models.quant import BlockQuantized

#: Rows of every GEMM call on the torch path (a step's rows are cut into tiles of this many).
TILE_ROWS = 16

_KINDS = {torch.bfloat16: 0, torch.float32: 1}
_MODES = {0: "none", 1: "avx512_bf16", 2: "amx"}


def kernel_mode(force: Optional[str] = None) -> str:
    """The native kernel this process runs: ``"amx"``, ``"avx512_bf16"`` or ``"none"`` (torch tiles).

    Args:
        force: Cap the mode (``"avx512_bf16"`` to run that path on a machine with AMX, for tests); layers made
            before keep their packing, which both modes read.
    """
    if not native.load():
        return "none"
    cap = -1 if force is None else {v: k for k, v in _MODES.items()}[force]
    return _MODES[torch.ops.goodserve.bi_gemm_mode(cap)]


def native_fits(n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether the native kernel takes an ``[n, k]`` weight with ``dtype`` activations (``n`` a multiple of
    16, ``k`` of 32, float32 or bfloat16, the kernel built)."""
    return n % 16 == 0 and k % 32 == 0 and dtype in _KINDS and kernel_mode() != "none"


_OFFSETS = {"Q4_0": 8.0, "Q4_1": 0.0, "Q8_0": 0.0}


def pack(weight: Union[torch.Tensor, BlockQuantized], dtype: torch.dtype) -> torch.Tensor:
    """``[N, K]`` -> the native layout: bfloat16 ``[N/16, K/32, 16, 16, 2]`` (k pairs, n, pair), a GGUF block
    weight dequantized on the way in one pass (the values of its dense bfloat16 copy); float32
    ``[N/16, K, 16]``."""
    n, k = weight.shape
    if isinstance(weight, BlockQuantized) and weight.qtype not in _OFFSETS:  # K-quant, Q5_0/Q5_1: float32 values
        weight = weight.dequantize()
    if dtype == torch.bfloat16:
        if isinstance(weight, BlockQuantized):
            return torch.ops.goodserve.bi_pack(None, weight.q.contiguous(), weight.scales.float().contiguous(),
                                               None if weight.mins is None else weight.mins.float().contiguous(),
                                               _OFFSETS[weight.qtype], n, k)
        return torch.ops.goodserve.bi_pack(weight.to(dtype).contiguous(), None, None, None, 0.0, n, k)
    dense = weight.dequantize() if isinstance(weight, BlockQuantized) else weight
    return dense.to(torch.float32).view(n // 16, 16, k).permute(0, 2, 1).contiguous()


class InvariantLinear(nn.Module):
    """``y = x W^T (+ b)`` with each row's result independent of the batch (see the module docstring).

    Args:
        weight: ``[out, in]`` tensor, or a GGUF :class:`BlockQuantized` (dequantized).
        bias: ``[out]`` or ``None``.
        dtype: Activation dtype, float32 or bfloat16.

    Raises:
        ValueError: for another activation dtype.
    """

    def __init__(self, weight: Union[torch.Tensor, BlockQuantized], bias: Optional[torch.Tensor],
                 dtype: torch.dtype) -> None:
        super().__init__()
        if dtype not in _KINDS:
            raise ValueError(f"batch-invariant linear layers run in float32 or bfloat16, not {dtype}")
        self.dtype = dtype
        self.out_features, self.in_features = weight.shape
        self.packed: Optional[torch.Tensor] = None
        self._dense: Optional[nn.Module] = None
        on_cpu = isinstance(weight, BlockQuantized) or weight.device.type == "cpu"
        if on_cpu and native_fits(self.out_features, self.in_features, dtype):
            self.packed = pack(weight, dtype)
            self.bias = None if bias is None else bias.float().contiguous()
        else:
            dense = weight.dequantize() if isinstance(weight, BlockQuantized) else weight
            self._dense = dense_linear(dense.to(dtype), bias)
            self.bias = None if bias is None else bias.to(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight a call reads."""
        return self.out_features * self.in_features * torch.finfo(self.dtype).bits // 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[rows, in_features]`` in the activation dtype -> ``[rows, out_features]``."""
        if self.packed is None:
            return _tiled(self._dense, x, self.out_features)
        if x.dtype != self.dtype or x.dim() != 2 or x.stride(1) != 1:
            x = x.to(self.dtype).contiguous()
        return torch.ops.goodserve.bi_gemm(x, self.packed, self.out_features, self.bias)

    @property
    def kind(self) -> int:
        """The native kernel's weight kind (0 bfloat16, 1 float32), for the one-call decode step."""
        return _KINDS[self.dtype]


def sequential_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` in index order, whatever the other dimensions' sizes: the last element of a
    ``cumsum`` (a sequential scan; a reduction may instead split one row across threads when few rows are
    reduced, so a row's sum would change with the batch)."""
    return x.cumsum(dim).select(dim, -1)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``[rows, hidden]`` (weight applied after the cast back, as HF does) with the mean square
    summed in order: the torch path of the batch-invariant mode."""
    h = x.float()
    mean_square = sequential_sum(h * h, -1).unsqueeze(-1) / h.shape[-1]
    return weight * (h * torch.rsqrt(mean_square + eps)).to(x.dtype)


def _tiled(layer: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
    """``layer(x)`` computed on row tiles of exactly :data:`TILE_ROWS` rows (the last zero-padded)."""
    rows = x.shape[0]
    padded = -(-rows // TILE_ROWS) * TILE_ROWS
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    out = torch.empty((padded, n), dtype=x.dtype, device=x.device)
    for start in range(0, padded, TILE_ROWS):
        out[start:start + TILE_ROWS] = layer.forward(x[start:start + TILE_ROWS])
    return out[:rows]
