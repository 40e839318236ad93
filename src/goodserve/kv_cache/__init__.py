"""Paged KV-cache bookkeeping (no tensors): the block pool, block hashing and the per-request manager."""

from goodserve.kv_cache.block_pool import BlockPool, KVBlock
from goodserve.kv_cache.hashing import BlockHash, hash_block_tokens
from goodserve.kv_cache.manager import KVCacheManager

__all__ = ["BlockHash", "BlockPool", "KVBlock", "KVCacheManager", "hash_block_tokens"]
