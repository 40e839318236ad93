"""Fake (meta) implementations of the ``torch.ops.goodserve`` kernels: the shape and dtype of each op's
output from its inputs, for ``torch.compile`` and meta tensors (``torch.library.register_fake``). The schemas
are in ``csrc/torch_bindings.cpp``; imported once the library is loaded (:mod:`goodserve.models.native_build`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import register_fake


@register_fake("goodserve::paged_decode_attention")
def _paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, split_tokens, num_splits, scale):
    return q.new_empty(q.shape)


@register_fake("goodserve::paged_attention_rows")
def _paged_attention_rows(q, k_cache, v_cache, block_tables, seq_lens, runs, split_tokens, num_splits, scale):
    return q.new_empty(q.shape)


@register_fake("goodserve::rms_norm")
def _rms_norm(x, weight, eps, residual: Optional[torch.Tensor]):
    return x.new_empty(x.shape), x.new_empty((x.shape[0] if residual is not None else 0, x.shape[1]))


@register_fake("goodserve::head_rms_norm")
def _head_rms_norm(x, weight, eps):
    return x.new_empty(x.shape)


@register_fake("goodserve::rope")
def _rope(x, table, positions):
    return x.new_empty(x.shape)


@register_fake("goodserve::silu_mul")
def _silu_mul(gate_up):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@register_fake("goodserve::argmax")
def _argmax(x):
    return x.new_empty((x.shape[0],), dtype=torch.int64)


@register_fake("goodserve::block_gemv")
def _block_gemv(x, kind, codes, scales, mins, offset, out_dtype):
    return x.new_empty((x.shape[0], scales.shape[0]), dtype=out_dtype)


@register_fake("goodserve::block_gemv_grouped")
def _block_gemv_grouped(x, kind, codes, scales, mins, offset, groups, out_dtype):
    return x.new_empty((x.shape[0], scales.shape[1]), dtype=out_dtype)


@register_fake("goodserve::moe_block")
def _moe_block(x, router, top_k, renormalise, scaling, float32_weighting, part_ptrs, part_ints, inter):
    return x.new_empty(x.shape)


@register_fake("goodserve::bi_gemm")
def _bi_gemm(x, packed, n, bias):
    return x.new_empty((x.shape[0], n))


@register_fake("goodserve::decode_layers")
def _decode_layers(layer_ptrs, layer_ints, k_caches, v_caches, embeddings, positions, slot_mapping, block_tables,
                   seq_lens, rope_table, final_norm, shape, eps, block_size, split_tokens, num_splits, amx_attention,
                   runs):
    return embeddings.new_empty((embeddings.shape[0], shape[0]))


@register_fake("goodserve::bi_pack")
def _bi_pack(w, q, scales, mins, offset, n, k):
    return (w if w is not None else q).new_empty((n // 16, k // 32, 16, 16, 2), dtype=torch.bfloat16)
