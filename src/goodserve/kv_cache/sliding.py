"""Freeing the blocks a sliding-window KV-cache group no longer reads.

In a model whose every layer attends within a window of ``W`` tokens (Mistral 7B, Jiang et al. 2023, §2), a
query at position ``p`` reads positions ``p - W + 1 .. p`` only. Once a request's next query is at ``p``, every
block wholly before ``p - W + 1`` is dead for it: :class:`SlidingWindow` returns those blocks to the pool (vLLM's
hybrid KV-cache manager, ``SlidingWindowManager.remove_skipped_blocks``; this is our own code). The request's
block table keeps ``None`` in their place so that entry ``i`` still holds token ``i * block_size``; the manager
reports it as :data:`NULL_BLOCK_ID` (the runner's copy of the table, sent as diffs of new entries, may still hold
the old id of a freed block), and windowed attention starts at the window's first block, so no entry before it
is ever read.

A freed block keeps its prefix-cache hash (it joins the free queue like any block a finished request frees),
so a later request may still hit it while it is not evicted. A prefix hit of ``k`` blocks needs only the blocks
the window of its first computed token (position ``k * block_size``) reads to be cached (vLLM's sliding-window
rule, :meth:`SlidingWindow.valid_hits`): the chained block hashes already say that the tokens before them
match, and the K/V of the blocks before the window is never read again. Those blocks are not referenced.

No torch here.
"""

from __future__ import annotations

from typing import Optional

from goodserve.kv_cache.block_pool import BlockPool, KVBlock

#: The id a block table entry reads as once its block was freed; never a valid block (a gather by it raises, but a
#: Python or slice index of -1 would wrap: nothing may read an entry before the window).
NULL_BLOCK_ID = -1


class SlidingWindow:
    """The window rule of a KV cache whose every layer attends within ``window`` tokens.

    Args:
        window: ``W``, tokens a query sees (itself included).
        block_size: Token slots per block.

    Raises:
        ValueError: if ``window`` or ``block_size`` is below 1.
    """

    def __init__(self, window: int, block_size: int) -> None:
        if window < 1 or block_size < 1:
            raise ValueError(f"window and block_size must be >= 1, got {window} and {block_size}")
        self.window = window
        self.block_size = block_size

    def first_needed_block(self, query_pos: int) -> int:
        """Index of the first block a query at ``query_pos`` (and every later one) reads: blocks before it hold
        only positions ``< query_pos - window + 1``."""
        return max(0, query_pos - self.window + 1) // self.block_size

    def drop_before(self, pool: BlockPool, table: list[Optional[KVBlock]], query_pos: int) -> int:
        """Free the table's blocks before :meth:`first_needed_block` ``(query_pos)``, leaving ``None`` entries.

        Blocks join the free queue oldest first (evicted before the rest of the request's blocks).

        Returns:
            The number of blocks freed by this call.
        """
        end = min(self.first_needed_block(query_pos), len(table))
        dead = [b for b in table[:end] if b is not None]
        for i in range(end):
            table[i] = None
        pool.free_blocks(dead)
        return len(dead)

    def max_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of up to ``num_tokens`` tokens holds at once when each step computes at most
        ``max_chunk`` of its tokens: a step from position ``c`` holds blocks covering ``[c - W + 1, c + n)``."""
        whole = -(-num_tokens // self.block_size)
        return min(whole, -(-(self.window - 1 + min(max_chunk, num_tokens)) // self.block_size) + 1)

    def valid_hits(self, cached: list[bool]) -> list[bool]:
        """Per ``k`` in ``0 .. len(cached)``, whether a request can take its first ``k`` blocks as a prefix hit: the
        blocks ``first_needed_block(k * block_size) .. k - 1`` its first computed token's window reads are all
        cached.

        Args:
            cached: Per leading full block of the request's tokens, whether its chained hash is in the prefix cache.
        """
        ok, run_start = [True], 0  # run_start: first block of the run of cached blocks ending at the current one
        for i, hit in enumerate(cached):
            run_start = run_start if hit else i + 1
            ok.append(run_start <= self.first_needed_block((i + 1) * self.block_size))
        return ok

    def keep_hits(self, hits: list[KVBlock], num_hit_tokens: int) -> list[Optional[KVBlock]]:
        """The prefix hits a request whose first computed token is at ``num_hit_tokens`` references: ``None`` for
        those before its window (never read, so not taken)."""
        first = min(self.first_needed_block(num_hit_tokens), len(hits))
        return [None] * first + hits[first:]
