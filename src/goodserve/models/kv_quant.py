"""The int8 KV cache: rows quantised per token and KV head, each carrying its own float32 scale.

Layout. A layer's K cache (and its V cache alike) is one int8 tensor
``[num_blocks, block_size, num_kv_heads, head_dim + 4]``: each row is ``head_dim`` int8 codes followed by
the 4 bytes of its float32 scale (:data:`~goodserve.kv_cache.spec.INT8_SCALE_BYTES`). The value of element
``d`` is ``scale * code[d]``. A block therefore stays self-contained, like a float block: prefix caching,
preemption and the KV connector (which registers the per-layer tensors and moves whole token rows) work on
it unchanged, and move :func:`goodserve.kv_cache.spec.kv_row_bytes` bytes per row.

Quantisation. Symmetric absmax per row (token and KV head): ``scale = max|x| / 127`` and
``code = round(x / scale)`` in ``[-127, 127]``; an all-zero row has scale 0. This is llama.cpp's q8_0
applied to a whole head row rather than to blocks of 32; KIVI (Liu et al. 2024) and KVQuant (Hooper et al.
2024) quantise K per channel to reach fewer bits, which int8 does not need. An element's error is at
most half a step, ``0.5 / 127`` of its row's absmax.

Readers: :func:`read_kv` (:func:`dequantize` for int8) for the torch reference backend and MLA (gathered
context only, never the whole cache); the native decode kernel (``csrc/paged_decode_attention.cpp``) reads
codes and scale in place.
"""

from __future__ import annotations

import torch

from goodserve.kv_cache.spec import INT8_SCALE_BYTES

#: Largest code magnitude (symmetric: -128 is never used).
QMAX = 127


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds int8 rows with their scales (the layout of this module)."""
    return cache.dtype == torch.int8


def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                kv_dtype: str) -> tuple[int, int, int, int]:
    """Shape of one layer's K (or V) cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, or
    ``[..., head_dim + 4]`` for ``int8`` (the row's float32 scale in its last 4 bytes)."""
    width = head_dim + (INT8_SCALE_BYTES if kv_dtype == "int8" else 0)
    return num_blocks, block_size, num_kv_heads, width


def head_dim_of(cache: torch.Tensor) -> int:
    """Elements of a K/V head in ``cache`` (its last dimension, less the scale bytes for int8)."""
    return cache.shape[-1] - (INT8_SCALE_BYTES if is_quantized(cache) else 0)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Quantise rows to int8 with a float32 absmax scale each.

    Args:
        x: ``[..., head_dim]`` float32 or bfloat16.

    Returns:
        ``[..., head_dim + 4]`` int8: the codes, then the scale's 4 bytes (native byte order).
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / QMAX  # [..., 1]
    codes = torch.round(xf / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(-QMAX, QMAX)
    return torch.cat([codes.to(torch.int8), scale.contiguous().view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale * code`` of quantised rows.

    Args:
        rows: ``[..., head_dim + 4]`` int8, as :func:`quantize` makes them.
        dtype: The output dtype.

    Returns:
        ``[..., head_dim]`` in ``dtype`` (computed in float32, rounded once).
    """
    width = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., width:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :width].float() * scale).to(dtype)


def read_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows a step has gathered, in the activations' ``dtype``: dequantized for an int8 cache (``[...,
    head_dim + 4]`` -> ``[..., head_dim]``), widened for a bfloat16 cache under float32, else unchanged."""
    return dequantize(rows, dtype) if is_quantized(rows) else rows.to(dtype)


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """Write new K (or V) rows into their cache slots, quantising them for an int8 cache (rounding them to a
    bfloat16 cache under float32 activations).

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, width]``, written in place (``width`` is ``head_dim``,
            or ``head_dim + 4`` for int8).
        slot_mapping: ``[num_tokens]`` int64 slot of each row.
        x: ``[num_tokens, num_kv_heads, head_dim]``.
    """
    num_kv_heads, width = cache.shape[2], cache.shape[3]
    rows = quantize(x) if is_quantized(cache) else x.to(cache.dtype)
    cache.view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, rows)
