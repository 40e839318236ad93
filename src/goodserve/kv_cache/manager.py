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

A model's layers may form several **KV-cache groups** (:mod:`goodserve.kv_cache.layout`): each group keeps its
own block table per request, drawn from the one pool and registered in the prefix cache under its own keys
(:func:`~goodserve.kv_cache.hashing.group_key`). A group whose layers attend within a window frees the blocks
before the window of a request's next query as it advances (:mod:`goodserve.kv_cache.sliding`): its table keeps
``None`` there, read as :data:`~goodserve.kv_cache.sliding.NULL_BLOCK_ID`. Outside this module a request's tables
are one flat list, logical block ``i`` of group ``g`` at ``i * num_groups + g``.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from goodserve.kv_cache.block_pool import BlockPool, KVBlock
from goodserve.kv_cache.hashing import BlockHash, group_key, hash_request_blocks, is_block_hash
from goodserve.kv_cache.layout import max_blocks_needed
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
        enable_kv_events: Record the prefix cache's changes as KV events (:meth:`take_kv_events`); only the first
            group's blocks are published (one block per token range, as a one-group engine's).
        group_windows: Per KV-cache group, the window its layers attend within (the blocks before each request's
            window are freed), or ``None`` (full attention: keep every block). Default: one full group.

    Raises:
        ValueError: if ``num_blocks``, ``block_size`` or a window is below 1, or no group is given.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 enable_kv_events: bool = False, group_windows: Sequence[Optional[int]] = (None,)) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not group_windows:
            raise ValueError("a KV cache manager needs at least one group")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        if enable_kv_events:
            self.block_pool.events = []
        #: Per group its window rule, or ``None`` (full attention).
        self.windows = [SlidingWindow(w, block_size) if w is not None else None for w in group_windows]
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.windows)
        # Per request, per group its table (None: freed before the window); all groups' tables have one length.
        self._req_blocks: dict[str, list[list[Optional[KVBlock]]]] = {}
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
        """The request's flat block table from entry ``start`` on (a multiple of ``num_groups``): block ids, first
        token's first, logical block ``i`` of group ``g`` at ``i * num_groups + g``; a block freed before a
        sliding window reads as ``NULL_BLOCK_ID``. ``[]`` if it holds none."""
        tables = self._req_blocks.get(request_id)
        if tables is None:
            return []
        first = start // self.num_groups
        return [NULL_BLOCK_ID if b is None else b.block_id for row in zip(*(t[first:] for t in tables)) for b in row]

    def max_blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once, computed ``max_chunk`` tokens a step at
        most: per group all of them, or with a sliding window only those the window and one chunk span."""
        return max_blocks_needed(self.group_windows, self.block_size, num_tokens, max_chunk)

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

        Every group must hit the same ``k`` blocks: a full group all of them, a sliding group only those inside
        the window of the first computed token (:meth:`SlidingWindow.valid_hits`); those before it come back as
        ``NULL_BLOCK_ID``.

        Args:
            request: A request with no blocks yet (waiting or preempted).

        Returns:
            ``(block_ids, num_cached_tokens)``: the flat table of the ``k`` hit blocks (``k * num_groups`` ids) and
            ``k * block_size``; ``([], 0)`` when prefix caching is off or the request asks for prompt logprobs.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        hashes = self._block_hashes(request)[:(request.num_tokens - 1) // self.block_size]
        found: list[list[Optional[KVBlock]]] = []
        k = len(hashes)
        for g, rule in enumerate(self.windows):
            blocks = []
            for block_hash in hashes[:k] if rule is None else hashes:
                blocks.append(self.block_pool.get_cached_block(group_key(block_hash, g)))
                if rule is None and blocks[-1] is None:
                    k = len(blocks) - 1  # a full group needs every block: no hit reaches past its first miss
                    break
            found.append(blocks)
        valid = [rule.valid_hits([b is not None for b in found[g]]) for g, rule in enumerate(self.windows) if rule]
        while not all(ok[k] for ok in valid):
            k -= 1
        starts = [0 if rule is None else rule.first_needed_block(k * self.block_size) for rule in self.windows]
        return [NULL_BLOCK_ID if i < starts[g] else found[g][i].block_id
                for i in range(k) for g in range(self.num_groups)], k * self.block_size

    # ------------------------------------------------------------------------------ allocation and free
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[list[int]] = None, cache: bool = True) -> Optional[list[int]]:
        """Grow the request's block tables to hold the tokens computed by this step.

        After the call every group's table covers ``request.num_computed_tokens + k * block_size +
        num_new_tokens`` slots (``k`` hit blocks). All or nothing across groups: on failure nothing changes,
        except that a sliding group's blocks before the window of the step's first query are freed first (they are
        dead whether or not the step runs), and its prefix hits before that window are never taken.

        Args:
            request: The request; ``num_computed_tokens`` must not yet include ``new_computed_blocks``.
            num_new_tokens: Tokens to compute this step (>= 0).
            new_computed_blocks: Prefix-cache hits from :meth:`get_computed_blocks` (a flat table, only for a
                request that holds no blocks yet); they get one more reference and leave the free queue.
            cache: Register the blocks that become full in the prefix cache now (``False`` when their K/V
                arrives later than the step, e.g. pulled from another instance: see :meth:`cache_blocks`).

        Returns:
            The newly allocated block ids as flat table entries (possibly ``[]``), or ``None`` when the pool lacks
            free blocks.

        Raises:
            ValueError: if ``num_new_tokens < 0``, or the hits are not whole rows of the flat table.
            RuntimeError: if prefix hits are given for a request that already holds blocks, or a full group's hit
                is ``NULL_BLOCK_ID``.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = request.request_id
        flat = new_computed_blocks or ()
        if len(flat) % self.num_groups:
            raise ValueError(f"{len(flat)} prefix hits are not whole rows of {self.num_groups} groups")
        hits = [[None if i == NULL_BLOCK_ID else self.block_pool.blocks[i] for i in flat[g::self.num_groups]]
                for g in range(self.num_groups)]
        tables = self._req_blocks.get(rid)
        if tables is None:
            tables = [[] for _ in self.windows]
        if any(None in h for h, rule in zip(hits, self.windows) if rule is None):
            raise RuntimeError(f"request {rid}: NULL_BLOCK_ID among a full-attention group's prefix hits")
        if flat and tables[0]:
            raise RuntimeError(f"request {rid} already holds {len(tables[0])} blocks per group; prefix hits are only "
                               "valid for a request without blocks")
        num_hit = len(flat) // self.num_groups
        first_query = request.num_computed_tokens + num_hit * self.block_size
        num_rows = _cdiv(first_query + num_new_tokens, self.block_size)
        for g, rule in enumerate(self.windows):
            if rule is not None:
                rule.drop_before(self.block_pool, tables[g], first_query)
                hits[g] = rule.keep_hits(hits[g], first_query)
        taken = [b for h in hits for b in h if b is not None]
        num_needed = max(0, num_rows - len(tables[0]) - num_hit)
        num_hits_in_free_queue = sum(1 for b in taken if b.ref_cnt == 0)
        if num_needed * self.num_groups > self.num_free_blocks - num_hits_in_free_queue:
            return None

        self.block_pool.touch(taken)  # before taking new blocks, so a hit is never evicted for them
        new_blocks = self.block_pool.get_new_blocks(num_needed * self.num_groups)  # row by row, as the flat table
        if rid not in self._req_blocks:
            self._req_blocks[rid] = tables
            self._num_registered[rid] = num_hit
        for g, table in enumerate(tables):
            table.extend(hits[g])
            table.extend(new_blocks[g::self.num_groups])
        if cache:
            self.cache_blocks(request, first_query + num_new_tokens)
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register in the prefix cache the request's blocks that ``num_tokens`` computed tokens fill."""
        if self.enable_prefix_caching:
            self._register_full_blocks(request, min(num_tokens, request.num_tokens) // self.block_size)

    def _register_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        """Register every group's blocks ``[already registered, num_full_blocks)`` in the prefix cache."""
        rid = request.request_id
        start = self._num_registered[rid]
        if num_full_blocks <= start:
            return
        hashes = self._block_hashes(request)
        for g, table in enumerate(self._req_blocks[rid]):
            events = self.block_pool.events if g == 0 else None
            run = None  # [first, end) of blocks newly cached, for one event
            for i in range(start, num_full_blocks):
                stored = table[i] is not None and self.block_pool.cache_full_block(table[i], group_key(hashes[i], g))
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
        :class:`~goodserve.kv_events.events.BlockRemoved`; the removals of groups other than the first, whose keys
        are not block hashes, left out); ``[]`` when events are not enabled."""
        events = self.block_pool.events
        if not events:
            return []
        merged: list[KVEvent] = []
        removed: list[bytes] = []  # a run of removals being merged
        for e in events:
            if isinstance(e, BlockRemoved):
                removed.extend(h for h in e.block_hashes if is_block_hash(h))
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
            The number of flat table entries it keeps, if any block was freed; else ``None``.
        """
        rid = request.request_id
        tables = self._req_blocks.get(rid)
        keep = _cdiv(num_tokens, self.block_size)
        if tables is None or len(tables[0]) <= keep:
            return None
        tail = [b for row in zip(*(t[keep:] for t in tables)) for b in row if b is not None]
        for table in tables:
            del table[keep:]
        self._num_registered[rid] = min(self._num_registered[rid], keep)
        self.block_pool.free_blocks(reversed(tail))
        return keep * self.num_groups

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
        tables = self._req_blocks.pop(rid, None) or [[]]
        self._req_hashes.pop(rid, None)
        self._num_registered.pop(rid, None)
        rows = list(zip(*tables))
        self.block_pool.free_blocks(b for row in reversed(rows) for b in reversed(row) if b is not None)
        if num_valid_tokens is not None:
            for row in rows[num_valid_tokens // self.block_size:]:
                for block in row:
                    if block is not None and block.ref_cnt == 0:
                        self.block_pool.uncache_block(block)

    def reset_prefix_cache(self) -> None:
        """Forget all cached hashes; in-use blocks stay allocated but will not be hit again."""
        self.block_pool.reset_prefix_cache()
        for rid, tables in self._req_blocks.items():
            self._num_registered[rid] = len(tables[0])  # never re-register blocks of running requests
        logger.info("prefix cache reset")

    # ---------------------------------------------------------------------------------------- checking
    def check_integrity(self) -> None:
        """Verify the pool's invariants.

        Raises:
            RuntimeError: naming the first violated invariant: free + in-use != total; a block owned
                twice by one request; a ref count that differs from the number of owning requests; a
                free-queue block with ``ref_cnt > 0``; an in-use block in the free queue; a hash that maps
                to a block holding another hash; usage above 1; a block in two groups' tables; group tables of
                unequal length.
        """
        pool = self.block_pool
        owners = [0] * pool.num_blocks
        group_of: dict[int, int] = {}  # block id -> the group whose tables hold it
        for rid, tables in self._req_blocks.items():
            if len({len(t) for t in tables}) != 1:
                raise RuntimeError(f"request {rid}'s group tables differ in length: {[len(t) for t in tables]}")
            ids = [b.block_id for t in tables for b in t if b is not None]
            if len(set(ids)) != len(ids):
                dup = sorted({i for i in ids if ids.count(i) > 1})
                raise RuntimeError(f"request {rid} owns block(s) {dup} more than once: table {ids}")
            for g, table in enumerate(tables):
                for i in (b.block_id for b in table if b is not None):
                    owners[i] += 1
                    if group_of.setdefault(i, g) != g:
                        raise RuntimeError(f"block {i} is in the tables of groups {group_of[i]} and {g}")
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
