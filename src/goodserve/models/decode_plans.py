"""Which weights a Llama-family model's one-call decode step (:func:`goodserve.models.native_decode.decode_layers`)
runs on, and the dense copy a block-quantized layer runs its larger steps on.

A model has up to two plans of that step:

* :func:`decode_plan`, made at load: every projection on the native block kernel, the GGUF file's blocks as
  stored (up to :data:`~goodserve.models.native_decode.DECODE_STEP_MAX_ROWS` rows), or in batch-invariant
  mode on the batch-invariant GEMM (up to
  :data:`~goodserve.models.native_decode.INVARIANT_DECODE_MAX_ROWS` rows);
* :func:`wide_plan`, made once the block-quantized layers have their dense copies, where those copies are the
  native GEMM's packed weights (:func:`dense_copy`): steps of more rows than
  :data:`goodserve.models.quant.DEFAULT_MAX_ROWS`, up to
  :data:`~goodserve.models.native_decode.INVARIANT_DECODE_MAX_ROWS`.

Why the wide plan: the block kernel reads its weights once per 4 rows, so past a few rows a step runs on dense
copies. Layer by layer that step pays ~15 dispatched ops in each layer; in one call it pays none, and on a CPU
whose OS grants AMX the native GEMM (``csrc/invariant_gemm.cpp``) reads a packed bfloat16 weight faster than
oneDNN's prepacked one at decode sizes and as fast at prefill sizes. From 5 rows the wide plan was also faster
than two passes of the block plan (BENCHMARKS.md, "Against llama.cpp on both files, Intel host, run 11").
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from goodserve.models import native, native_decode
from goodserve.models.invariant import InvariantLinear, kernel_mode, native_fits
from goodserve.models.kquant import PartsLinear
from goodserve.models.linear import dense_linear
from goodserve.models.quant import QuantLinear


def dense_copy(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> nn.Module:
    """The dense layer a :class:`~goodserve.models.quant.QuantLinear` of the file's blocks runs its steps of more
    than ``max_rows`` rows on: the native GEMM's packed weight (:class:`~goodserve.models.invariant.InvariantLinear`)
    for a bfloat16 ``[out, in]`` weight on the CPU when that GEMM runs on AMX and takes the shape (``out`` a
    multiple of 16, ``in`` of 32), so :func:`wide_plan` can run the step in one call; else oneDNN's
    (:func:`goodserve.models.linear.dense_linear`).

    Args:
        weight: ``[out, in]`` in the activation dtype (the values of the layer's codes).
        bias: ``[out]`` or ``None``.
    """
    n, k = weight.shape
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and native_fits(n, k, weight.dtype) \
            and kernel_mode() == "amx":
        return InvariantLinear(weight, bias, weight.dtype)
    return dense_linear(weight, bias)


def _block_parts(layer: nn.Module) -> Optional[list[tuple]]:
    """A projection's parts as :class:`~goodserve.models.native_decode.DecodeLayers` takes them, when every part
    runs on the block kernel without bias (a :class:`PartsLinear` of up to ``DECODE_STEP_PARTS`` of them); else
    None."""
    parts = _parts(layer)
    if parts is None or not all(isinstance(p, QuantLinear) and p.kind == "blocks" and p.bias is None for p in parts):
        return None
    return [(p.qtype, p.packed, p.extra, p.mins, p.offset, p.out_features) for p in parts]


def _invariant_parts(layers: list[nn.Module]) -> Optional[list[tuple]]:
    """``layers`` (side by side along the outputs) as the batch-invariant GEMM's parts of
    :class:`~goodserve.models.native_decode.DecodeLayers`, when each is an :class:`InvariantLinear` on the
    native kernel without bias; else None."""
    if not all(isinstance(p, InvariantLinear) and p.packed is not None and p.bias is None for p in layers):
        return None
    return [(native_decode.INVARIANT_KIND + p.kind, p.packed, None, None, 0, p.out_features) for p in layers]


def _copy_parts(layer: nn.Module) -> Optional[list[tuple]]:
    """A block-quantized projection's dense copies as the native GEMM's parts, when every part has its copy
    made and on that GEMM; else None."""
    parts = _parts(layer)
    if parts is None or not all(isinstance(p, QuantLinear) for p in parts):
        return None
    return _invariant_parts([p._dense for p in parts])


def _parts(layer: nn.Module) -> Optional[list[nn.Module]]:
    parts = list(layer.parts) if isinstance(layer, PartsLinear) else [layer]
    return parts if len(parts) <= native_decode.DECODE_STEP_PARTS else None


def decode_plan(model: nn.Module) -> Optional[native_decode.DecodeLayers]:
    """A :class:`~goodserve.models.llama.LlamaForCausalLM`'s one-call plan on the weights it loaded: every
    projection on the block kernel (whole, or as :class:`PartsLinear` parts), or in batch-invariant mode on the
    batch-invariant GEMM, without bias, every mixture of experts' experts on the block kernel
    (:meth:`goodserve.models.moe.SparseMoeBlock.decode_operands`), and the norms on the native kernels; else
    ``None``."""
    if model.batch_invariant:
        return _plan(model, lambda p: _invariant_parts([p]), moe=False)
    return _plan(model, _block_parts, moe=True)


def wide_plan(model: nn.Module) -> Optional[native_decode.DecodeLayers]:
    """The one-call plan on every block-quantized projection's dense copy (:func:`dense_copy`), for steps of
    more rows than the block kernel takes in one pass; ``None`` until every copy is made, where a copy is not
    on the native GEMM, for a mixture of experts, and in batch-invariant mode (whose plan is already that
    GEMM's)."""
    if model.batch_invariant:
        return None
    return _plan(model, _copy_parts, moe=False)


def _plan(model: nn.Module, parts_of, moe: bool) -> Optional[native_decode.DecodeLayers]:
    c = model.config
    if not native.usable(model.norm.weight) or c.sliding_window is not None \
            or (model.batch_invariant and c.qk_norm):
        return None  # the one-call kernel has no window and no in-order q/k norm
    layers = []
    for layer in model.layers:
        operands = None
        if layer.moe is not None:
            operands = layer.moe.decode_operands() if moe else None
            if operands is None:
                return None  # experts not on the block kernel
        projections = [layer.qkv_proj, layer.o_proj] + ([] if operands else [layer.gate_up_proj, layer.down_proj])
        ops = [parts_of(p) for p in projections]
        if any(parts is None for parts in ops):
            return None
        layers.append((layer.input_layernorm.weight, layer.post_attention_layernorm.weight, ops, layer.qk_norm,
                       operands))
    shape = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size)
    return native_decode.DecodeLayers(layers, shape, c.rms_norm_eps, model.norm.weight)
