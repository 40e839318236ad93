"""Sizing the KV pool: how the model's layers lie over it, how many blocks the memory holds, and the longest
request the pool can always finish.

The byte counts are the one formula of :mod:`goodserve.kv_cache.spec` (what ``goodserve plan`` prices), over the
layout the KV cache manager and the runner share (:mod:`goodserve.kv_cache.layout`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from goodserve.config import ModelConfig
from goodserve.engine.args import EngineArgs, default_kv_cache_memory, resolve_kv_cache_dtype
from goodserve.kv_cache.layout import KVCacheLayout, longest_request
from goodserve.models.config_support import resolve_max_model_len

logger = logging.getLogger(__name__)


def engine_kv_layout(model: ModelConfig, draft: Optional[ModelConfig] = None, kv_transfer: Optional[Any] = None,
                     hybrid: bool = True) -> KVCacheLayout:
    """The layout the engine runs: a model mixing local and global layers gets one group per kind (its local
    groups free the blocks before their window), unless ``hybrid`` is off, a draft model shares the pool's blocks
    or KV moves between instances (``kv_transfer``), which handle one group only.

    Raises:
        ValueError: for a model whose every layer slides, with disaggregated serving: moving a window whose
            leading blocks were freed is not implemented.
    """
    layout = model.kv_cache_layout(hybrid=hybrid and draft is None and kv_transfer is None)
    if kv_transfer is not None and layout.group_windows[0] is not None:
        raise ValueError(f"disaggregated serving (--kv-transfer-config) of a model whose every layer attends within "
                         f"a sliding window ({model.architecture}, window {layout.group_windows[0]}) is not "
                         "implemented; supported: models with full-attention layers")
    return layout


def resolve_pool(args: EngineArgs, model: ModelConfig, device: str,
                 draft: Optional[ModelConfig] = None) -> tuple[int, int, KVCacheLayout]:
    """Pick the layout, the pool size in blocks and the effective ``max_model_len``. With a draft model
    (speculation) a block holds both models' K/V, so the same KV budget holds fewer blocks.

    Returns:
        ``(num_blocks, max_model_len, layout)``. ``max_model_len`` never exceeds what the pool can hold (the
        blocks a request of that length holds at once, windows applied: :func:`longest_request`), so a request
        admitted alone can always finish, nor what the engine computes exactly
        (:func:`~goodserve.models.config_support.resolve_max_model_len`).

    Raises:
        ValueError: if the pool cannot hold a single block, or as :func:`engine_kv_layout`.
    """
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, args.dtype)
    layout = engine_kv_layout(model, draft, args.kv_transfer(), hybrid=not args.disable_hybrid_kv_cache_manager)
    hybrid = layout.num_groups > 1
    spec = model.kv_cache_spec(kv_dtype, hybrid)
    draft_spec = draft.kv_cache_spec(kv_dtype, hybrid=False) if draft else None  # its runner: one group
    bytes_per_block = spec.page_bytes(args.block_size) + (draft_spec.page_bytes(args.block_size) if draft_spec else 0)
    if args.num_blocks is not None:
        num_blocks = args.num_blocks
    else:
        memory = args.kv_cache_memory or default_kv_cache_memory(device)
        num_blocks = memory // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory of {memory} bytes holds no block of {bytes_per_block} bytes")
    max_model_len = resolve_max_model_len(args.max_model_len, model)
    # A step computes at most max_num_batched_tokens of a request in chunked mode, the whole prompt otherwise; a
    # draft model's own table keeps every block (and with one, the target's layout is one group).
    longest = longest_request(layout.group_windows if draft is None else (None,), args.block_size, num_blocks,
                              max_model_len, args.max_num_batched_tokens if args.scheduler == "chunked" else None)
    if longest < max_model_len:
        logger.warning("KV pool of %d blocks holds a request of at most %d tokens, fewer than max_model_len %d: "
                       "capping max_model_len to %d", num_blocks, longest, max_model_len, longest)
        max_model_len = longest
    # Requests of max_model_len tokens the pool holds at once, in whole blocks, windows applied (the spec's
    # formula, as `goodserve plan` prices it).
    request_bytes = spec.bytes_for_request(max_model_len, args.block_size) + (
        draft_spec.bytes_for_request(max_model_len, args.block_size) if draft_spec else 0)
    logger.info("KV cache (%s): %d blocks x %d tokens, %.1f MiB; max concurrency at %d tokens: %.2f",
                spec.describe(), num_blocks, args.block_size, num_blocks * bytes_per_block / 2**20,
                max_model_len, num_blocks * bytes_per_block / request_bytes)
    return num_blocks, max_model_len, layout
