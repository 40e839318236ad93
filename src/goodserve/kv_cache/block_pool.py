"""The physical KV block pool: ref counts, an LRU free queue and the prefix-cache index.

Memory is cut into fixed-size blocks of ``block_size`` token slots and a request's K/V lives in a list
of blocks that need not be contiguous (PagedAttention, Kwon et al., SOSP 2023, §4.1-§4.3). A block is
*in use* while at least one request references it (``ref_cnt > 0``), and *free* otherwise. A free block
may still hold the K/V of a full block registered under its :data:`BlockHash`: it is then a prefix-cache
entry that a later request can take back (:meth:`BlockPool.touch`) until the pool hands the block out
for new content, at which point its hash is dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Iterator, Optional

from goodserve.kv_cache.hashing import BlockHash
from goodserve.kv_events.events import AllBlocksCleared, BlockRemoved, KVEvent


class KVBlock:
    """Metadata of one physical KV block (the K/V tensors live in the model runner).

    Attributes:
        block_id: Index of the block in the pool, ``0 <= block_id < num_blocks``.
        ref_cnt: Number of requests whose block table holds this block.
        block_hash: Hash of the full block's content and prefix while it is registered in the prefix
            cache, else ``None``.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHash] = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    """All blocks of the pool, the free queue and the ``block_hash -> block`` prefix-cache map.

    The free queue is an ``OrderedDict`` keyed by block id, in eviction order: the head is evicted
    (reused for new content) first, freed blocks join at the tail. We chose it over a hand-written doubly
    linked list because it *is* one (CPython keeps a linked list beside the dict) and gives the three
    O(1) operations the pool needs without any pointer code to get wrong: pop the head
    (``popitem(last=False)``), append at the tail, and unlink any block by id when a prefix-cache hit
    takes it back (``pop(block_id)``). The order is therefore least-recently-freed first, i.e. LRU; the
    caller decides the order within one release (the KV cache manager frees a request's deepest block
    first, since a deeper block is only useful if all of its ancestors are still cached).

    Args:
        num_blocks: Blocks in the pool.

    Raises:
        ValueError: if ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        # KV events (:mod:`goodserve.kv_events`): removals and clears are appended here when it is a list
        # (the KV cache manager appends the stores, which need the request's chain); None: not recorded.
        self.events: Optional[list[KVEvent]] = None

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool."""
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0``, including evictable prefix-cache entries."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or free)."""
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (first is reused first)."""
        return list(self._free)

    def cached_items(self) -> Iterator[tuple[BlockHash, KVBlock]]:
        """``(hash, block)`` pairs of the prefix-cache map."""
        return iter(self._cached.items())

    def is_free(self, block_id: int) -> bool:
        """Whether the block sits in the free queue."""
        return block_id in self._free

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue for new content (``ref_cnt = 1``).

        A taken block that still held a cached hash is evicted from the prefix cache at that moment, so a
        stale hash never resolves to a recycled block.

        Args:
            num_blocks: How many blocks.

        Returns:
            The blocks, in the order they were taken.

        Raises:
            RuntimeError: if fewer than ``num_blocks`` blocks are free (callers check first).
        """
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks but only {len(self._free)} are free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self.uncache_block(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each block (a prefix-cache hit), unlinking free ones from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free-queue tail in the given order.

        Args:
            blocks: Blocks in eviction order (the first one reaching 0 will be reused first).

        Raises:
            RuntimeError: if a block is already free.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id} (ref_cnt={block.ref_cnt})")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full block under ``block_hash``.

        If another block already holds this hash (two requests computed the same content), the first
        one stays the cache entry and ``block`` is left unhashed.

        Returns:
            Whether ``block`` is now the cache entry for ``block_hash``.
        """
        if block.block_hash is not None:
            return block.block_hash == block_hash and self._cached.get(block_hash) is block
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVBlock]:
        """The block registered under ``block_hash``, or ``None`` (a miss)."""
        return self._cached.get(block_hash)

    def uncache_block(self, block: KVBlock) -> None:
        """Remove ``block`` from the prefix cache (no-op if it holds no hash)."""
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.append(BlockRemoved((block.block_hash,)))
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks and ref counts are untouched)."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
