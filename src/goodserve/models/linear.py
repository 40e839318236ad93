"""Dense linear layers on the CPU GEMM library's own weight layout.

``F.linear`` hands oneDNN a plain row-major weight, which its bfloat16 GEMM reorders into its blocked
layout on every call. Reordering once at load time (``mkldnn._reorder_linear_weight``, the weight prepacking
that ``torch.compile``'s freezing pass applies to CPU linears) and calling ``mkldnn._linear_pointwise`` on
the packed weight gives the same values, 1.5-2.5x faster at every decode batch size for the default model's
layers (BENCHMARKS.md, issue 15, run 4). It is used where it applies: a bfloat16 weight on a CPU where
oneDNN has a bfloat16 path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; elsewhere the reorder raises);
everything else (float32, CUDA, an AVX2-only CPU) stays on ``F.linear``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def onednn_has_bfloat16() -> bool:
    """Whether oneDNN has a bfloat16 path on this CPU (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX); on an
    AVX2-only CPU its reorder raises and PyTorch's bfloat16 GEMM falls back to a slow path."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can run on a prepacked oneDNN weight (bfloat16, on a CPU where oneDNN has a
    bfloat16 path)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and onednn_has_bfloat16())


class PackedLinear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` reordered once into oneDNN's blocked layout.

    Args:
        weight: ``[out_features, in_features]`` bfloat16 on the CPU (see :func:`can_pack`).
        bias: ``[out_features]`` or ``None``.

    Raises:
        ValueError: for a weight :func:`can_pack` refuses.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        if not can_pack(weight):
            raise ValueError(f"cannot prepack a {weight.dtype} weight on {weight.device} "
                             f"(bfloat16 on a CPU with oneDNN's bfloat16 path only)")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()))
        self.bias = None if bias is None else bias.to(weight.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight a call reads (the packed tensor is opaque; its layout holds the same values)."""
        return self.out_features * self.in_features * self.packed.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[rows, in_features]`` bfloat16 -> ``[rows, out_features]``."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def dense_linear(weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> nn.Module:
    """A :class:`PackedLinear` where :func:`can_pack` allows it, else an ``nn.Linear`` holding ``weight``."""
    if can_pack(weight):
        return PackedLinear(weight, bias)
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.to(weight.dtype), requires_grad=False)
    return layer
