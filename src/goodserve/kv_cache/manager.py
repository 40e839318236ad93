"""Per-request block tables on top of the :class:`BlockPool`, with automatic prefix caching.

A request's block table is the list of block ids whose slots hold its tokens: token ``t`` lives in block
``block_table[t // block_size]`` at offset ``t % block_size`` (PagedAttention, Kwon et al., SOSP 2023,
§4.2-§4.3). Full blocks are registered in the prefix cache under a chained hash of their tokens
(:mod:`goodserve.kv_cache.hashing`); a new request whose prompt starts with registered blocks reuses
them (ref count + 1) instead of recomputing them.

Registration happens in :meth:`KVCacheManager.allocate_slots`, as soon as a block is known to become full
once the step's tokens are computed. A request admitted later in the *same* step may therefore reuse
blocks that the step is still writing; this is correct because the runner writes every scheduled
token's K/V into the paged cache before attention reads it, layer by layer.

With ``sliding_window`` (a model whose every layer attends within that many tokens) the blocks before the
window of a request's next query are freed as it advances (:mod:`goodserve.kv_cache.sliding`): its table keeps
``None`` there, read as :data:`~goodserve.kv_cache.sliding.NULL_BLOCK_ID`.
"""

from __future__ import annotations

import logging
from typing import Optional

from goodserve.kv_cache.block_pool import BlockPool, KVBlock
from goodserve.kv_cache.hashing import BlockHash, hash_request_blocks
from goodserve.kv_cache.sliding import NULL_BLOCK_ID, SlidingWindow
from goodserve.kv_events.events import BlockRemoved, BlockStored, KVEvent
from goodserve.request import Request

logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates and frees the KV blocks of requests; finds prefix-cache hits.

    Args:
        num_blocks: Blocks in the pool.
        block_size: Token slots per block.
        enable_prefix_caching: Register full blocks by hash and reuse them across requests.
        enable_kv_events: Record the prefix cache's changes as KV events (:meth:`take_kv_events`).
        sliding_window: Every layer attends within this many tokens: free the blocks before each request's
            window (``None``: keep every block, full attention).

    Raises:
        ValueError: if ``num_blocks``, ``block_size`` or ``sliding_window`` is below 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 enable_kv_events: bool = False, sliding_window: Optional[int] = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        if enable_kv_events:
            self.block_pool.events = []
        self.sliding = SlidingWindow(sliding_window, block_size) if sliding_window is not None else None
        self._req_blocks: dict[str, list[Optional[KVBlock]]] = {}  # None: freed before the window
        self._req_hashes: dict[str, list[BlockHash]] = {}  # chained hashes of the full blocks so far
        self._num_registered: dict[str, int] = {}  # leading blocks of the table already registered
        self.prefix_cache_queries = 0  # prompt tokens looked up, at first admission (tokens)
        self.prefix_cache_hits = 0  # of which found in the cache (tokens)

    # ----------------------------------------------------------------------------------- read-only state
    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool."""
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any request (evictable cached blocks included)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction (0..1) of blocks referenced by at least one request."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """``prefix_cache_hits / prefix_cache_queries`` (0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def get_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block table from entry ``start`` on (block ids, first token's block first; a block freed
        before a sliding window reads as ``NULL_BLOCK_ID``); ``[]`` if it holds none."""
        return [NULL_BLOCK_ID if b is None else b.block_id for b in self._req_blocks.get(request_id, ())[start:]]

    def max_blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once, computed ``max_chunk`` tokens a step at
        most: all of them, or with a sliding window only those the window and one chunk span."""
        if self.sliding is None:
            return _cdiv(num_tokens, self.block_size)
        return self.sliding.max_blocks(num_tokens, max_chunk)

    def record_prefix_cache_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one request's prefix-cache lookup in :attr:`prefix_cache_queries` / ``_hits`` (tokens)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_query_tokens
            self.prefix_cache_hits += num_hit_tokens

    # ----------------------------------------------------------------------------------------- lookups
    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Chained hashes of every full block of ``request.all_token_ids``, memoised per request."""
        salt = getattr(request, "cache_salt", None)
        hashes = hash_request_blocks(request.all_token_ids, self.block_size, extra_keys=(salt,),
                                     known=self._req_hashes.get(request.request_id, ()))
        self._req_hashes[request.request_id] = hashes
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks matching the start of ``request.all_token_ids``.

        The last token is always left to compute (its logits give the next token), so a sequence that
        is an exact multiple of ``block_size`` can hit at most all blocks but the last. No reference is
        taken: pass the ids to :meth:`allocate_slots` in the same scheduling pass.

        With a sliding window only the blocks inside the window of the first computed token must be cached
        (:meth:`SlidingWindow.longest_hit`); those before it come back as ``NULL_BLOCK_ID``.

        Args:
            request: A request with no blocks yet (waiting or preempted).

        Returns:
            ``(block_ids, num_cached_tokens)`` with ``num_cached_tokens == len(block_ids) * block_size``;
            ``([], 0)`` when prefix caching is off or the request asks for prompt logprobs.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding is not None:
            blocks = [self.block_pool.get_cached_block(h) for h in self._block_hashes(request)[:max_hit_blocks]]
            k = self.sliding.longest_hit([b is not None for b in blocks])
            first = self.sliding.first_needed_block(k * self.block_size)
            return [NULL_BLOCK_ID] * first + [b.block_id for b in blocks[first:k]], k * self.block_size
        hit: list[int] = []
        for block_hash in self._block_hashes(request)[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block.block_id)
        return hit, len(hit) * self.block_size

    # ------------------------------------------------------------------------------ allocation and free
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[list[int]] = None, cache: bool = True) -> Optional[list[int]]:
        """Grow the request's block table to hold the tokens computed by this step.

        After the call the table covers ``request.num_computed_tokens + len(new_computed_blocks) *
        block_size + num_new_tokens`` slots. All or nothing: on failure nothing changes, except that with a
        sliding window the blocks before the window of the step's first query are freed first (they are dead
        whether or not the step runs), and prefix hits before that window are never taken.

        Args:
            request: The request; ``num_computed_tokens`` must not yet include ``new_computed_blocks``.
            num_new_tokens: Tokens to compute this step (>= 0).
            new_computed_blocks: Prefix-cache hits from :meth:`get_computed_blocks` (only for a request
                that holds no blocks yet); they get one more reference and leave the free queue.
            cache: Register the blocks that become full in the prefix cache now (``False`` when their K/V
                arrives later than the step, e.g. pulled from another instance: see :meth:`cache_blocks`).

        Returns:
            The newly allocated block ids (possibly ``[]``), or ``None`` when the pool lacks free blocks.

        Raises:
            ValueError: if ``num_new_tokens < 0``.
            RuntimeError: if prefix hits are given for a request that already holds blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = request.request_id
        hits = [None if i == NULL_BLOCK_ID else self.block_pool.blocks[i] for i in (new_computed_blocks or ())]
        table = self._req_blocks.get(rid, [])
        if None in hits and self.sliding is None:
            raise RuntimeError(f"request {rid}: NULL_BLOCK_ID among prefix hits without a sliding window")
        if hits and table:
            raise RuntimeError(f"request {rid} already holds {len(table)} blocks; prefix hits are only "
                               "valid for a request without blocks")
        first_query = request.num_computed_tokens + len(hits) * self.block_size
        num_slots = first_query + num_new_tokens
        if self.sliding is not None:
            self.sliding.drop_before(self.block_pool, table, first_query)
            hits = self.sliding.keep_hits(hits, first_query)
        taken = [b for b in hits if b is not None]
        num_needed = max(0, _cdiv(num_slots, self.block_size) - len(table) - len(hits))
        num_hits_in_free_queue = sum(1 for b in taken if b.ref_cnt == 0)
        if num_needed > self.num_free_blocks - num_hits_in_free_queue:
            return None

        self.block_pool.touch(taken)  # before taking new blocks, so a hit is never evicted for them
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        if rid not in self._req_blocks:
            self._req_blocks[rid] = table
            self._num_registered[rid] = len(hits)
        table.extend(hits)
        table.extend(new_blocks)
        if cache:
            self.cache_blocks(request, num_slots)
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register in the prefix cache the request's blocks that ``num_tokens`` computed tokens fill."""
        if self.enable_prefix_caching:
            self._register_full_blocks(request, min(num_tokens, request.num_tokens) // self.block_size)

    def _register_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        """Register the request's blocks ``[already registered, num_full_blocks)`` in the prefix cache."""
        rid = request.request_id
        start = self._num_registered[rid]
        if num_full_blocks <= start:
            return
        hashes = self._block_hashes(request)
        table = self._req_blocks[rid]
        events, run = self.block_pool.events, None  # run: [first, end) of blocks newly cached, for one event
        for i in range(start, num_full_blocks):
            stored = table[i] is not None and self.block_pool.cache_full_block(table[i], hashes[i])
            if events is not None and stored:
                run = (run[0] if run else i, i + 1)
            if events is not None and run and (not stored or i == num_full_blocks - 1):
                self._stored_event(request, hashes, *run)
                run = None
        self._num_registered[rid] = num_full_blocks

    def _stored_event(self, request: Request, hashes: list[BlockHash], first: int, end: int) -> None:
        bs = self.block_size
        self.block_pool.events.append(BlockStored(tuple(hashes[first:end]), hashes[first - 1] if first else None,
                                                  tuple(request.all_token_ids[first * bs:end * bs]), bs))

    def take_kv_events(self) -> list[KVEvent]:
        """The KV events recorded since the last call, oldest first (consecutive removals merged into one
        :class:`~goodserve.kv_events.events.BlockRemoved`); ``[]`` when events are not enabled."""
        events = self.block_pool.events
        if not events:
            return []
        merged: list[KVEvent] = []
        removed: list[bytes] = []  # a run of removals being merged
        for e in events:
            if isinstance(e, BlockRemoved):
                removed.extend(e.block_hashes)
                continue
            if removed:
                merged.append(BlockRemoved(tuple(removed)))
                removed = []
            merged.append(e)
        if removed:
            merged.append(BlockRemoved(tuple(removed)))
        events.clear()
        return merged

    def trim(self, request: Request, num_tokens: int) -> Optional[int]:
        """Free the request's blocks past those its first ``num_tokens`` slots need: the slots of draft
        tokens that verification rejected. They never held a full block of known tokens, so none is in the
        prefix cache; they join the free queue without a hash.

        Returns:
            The number of blocks it keeps, if any was freed; else ``None``.
        """
        rid = request.request_id
        table = self._req_blocks.get(rid)
        keep = _cdiv(num_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return None
        tail = [b for b in table[keep:] if b is not None]
        del table[keep:]
        self._num_registered[rid] = min(self._num_registered[rid], keep)
        self.block_pool.free_blocks(reversed(tail))
        return keep

    def free(self, request: Request, num_valid_tokens: Optional[int] = None) -> None:
        """Release the request's blocks (ref - 1 each).

        Blocks reaching ``ref_cnt == 0`` join the free queue deepest block first, after every block
        freed earlier: eviction takes least-recently-used blocks first and, within a request, the end
        of the sequence before its start. They keep their hash, so a later request can still hit them.

        Args:
            request: The request; a no-op if it holds no blocks.
            num_valid_tokens: If given, only the first ``num_valid_tokens`` slots hold computed K/V (the
                request is dropped between scheduling and execution); blocks beyond them that become
                free lose their hash so nobody reuses K/V that was never written.
        """
        rid = request.request_id
        table = self._req_blocks.pop(rid, [])
        self._req_hashes.pop(rid, None)
        self._num_registered.pop(rid, None)
        self.block_pool.free_blocks(b for b in reversed(table) if b is not None)
        if num_valid_tokens is not None:
            for block in table[num_valid_tokens // self.block_size:]:
                if block is not None and block.ref_cnt == 0:
                    self.block_pool.uncache_block(block)

    def reset_prefix_cache(self) -> None:
        """Forget all cached hashes; in-use blocks stay allocated but will not be hit again."""
        self.block_pool.reset_prefix_cache()
        for rid, table in self._req_blocks.items():
            self._num_registered[rid] = len(table)  # never re-register blocks of running requests
        logger.info("prefix cache reset")

    # ---------------------------------------------------------------------------------------- checking
    def check_integrity(self) -> None:
        """Verify the pool's invariants.

        Raises:
            RuntimeError: naming the first violated invariant: free + in-use != total; a block owned
                twice by one request; a ref count that differs from the number of owning requests; a
                free-queue block with ``ref_cnt > 0``; an in-use block in the free queue; a hash that maps
                to a block holding another hash; usage above 1.
        """
        pool = self.block_pool
        owners = [0] * pool.num_blocks
        for rid, table in self._req_blocks.items():
            ids = [b.block_id for b in table if b is not None]
            if len(set(ids)) != len(ids):
                dup = sorted({i for i in ids if ids.count(i) > 1})
                raise RuntimeError(f"request {rid} owns block(s) {dup} more than once: table {ids}")
            for i in ids:
                owners[i] += 1
        num_in_use = 0
        for block in pool.blocks:
            in_queue = pool.is_free(block.block_id)
            if block.ref_cnt != owners[block.block_id]:
                raise RuntimeError(f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                                   f"{owners[block.block_id]} owning request(s)")
            if in_queue and block.ref_cnt > 0:
                raise RuntimeError(f"block {block.block_id} is in the free queue with ref_cnt "
                                   f"{block.ref_cnt}")
            if not in_queue and block.ref_cnt == 0:
                raise RuntimeError(f"block {block.block_id} has ref_cnt 0 but is not in the free queue")
            num_in_use += block.ref_cnt > 0
        if pool.num_free_blocks + num_in_use != pool.num_blocks:
            raise RuntimeError(f"free ({pool.num_free_blocks}) + in use ({num_in_use}) != total "
                               f"({pool.num_blocks}) blocks")
        for block_hash, block in pool.cached_items():
            if block.block_hash != block_hash:
                raise RuntimeError(f"hash {block_hash.hex()[:16]} maps to block {block.block_id} whose "
                                   f"hash is {block.block_hash.hex()[:16] if block.block_hash else None}")
        if not 0.0 <= self.usage <= 1.0:
            raise RuntimeError(f"usage {self.usage} is outside [0, 1]")
