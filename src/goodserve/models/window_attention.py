"""Attention metadata for layers that attend within a sliding window.

A layer with window ``W`` lets a query at position ``p`` attend positions ``p - W + 1 .. p`` only (transformers'
``sliding_window_overlay``, ``kv_idx > q_idx - W``; Mistral 7B, Jiang et al. 2023, §2; Gemma 3's local layers).
:func:`build_windowed` cuts every request's block table to start at the first block its window touches, so a
windowed layer reads ``O(W)`` positions and never a block before the window (with a sliding KV-cache group those
were freed and the runner's table holds ``NULL_BLOCK_ID`` or a stale id there,
:mod:`goodserve.kv_cache.sliding`), and masks the positions of that first block before the window.

The result is an :class:`~goodserve.models.attention.AttentionMetadata` in the decode-group layout that
:class:`~goodserve.models.attention.TorchAttentionBackend` (and the native backend, which falls back to it for
such metadata) attends; it shares the step's ``slot_mapping``.
"""

from __future__ import annotations

import torch

from goodserve.kv_cache.sliding import SlidingWindow
from goodserve.models.attention import AttentionMetadata, DecodeGroup, PrefillChunk, padding_runs


def build_windowed(block_size: int, window: int, decode_block_tables: list[list[int]], decode_seq_lens: list[int],
                   prefill_chunks: list[tuple[int, int, list[int]]], slot_mapping: torch.Tensor,
                   device: torch.device) -> AttentionMetadata:
    """:meth:`AttentionMetadata.build`'s arguments, for a layer attending within ``window`` tokens.

    Args:
        block_size: Tokens per block.
        window: ``W`` in tokens (>= 1).
        decode_block_tables: Each decode's block table (covering its context), in batch order.
        decode_seq_lens: Each decode's context length, its new token included (its query is at ``len - 1``).
        prefill_chunks: ``(num_computed_tokens, num_new_tokens, block_table)`` of each chunk, after the decodes.
        slot_mapping: ``[num_tokens]`` the step's cache slots.
        device: Where the tensors live.

    Returns:
        Metadata whose decode groups and prefill chunks read blocks from each window's first on: a decode
        group's ``mask`` ``[n, 1, 1, max_blocks * block_size]`` is True on ``lo <= pos < len`` (positions
        relative to the cut table); a chunk's ``mask`` ``[num_new, ctx]`` is True where ``q - W < k <= q``
        (``None`` when plain causal attention over the chunk's own tokens is already within the window).

    Raises:
        ValueError: if ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    rule = SlidingWindow(window, block_size)  # the KV cache manager's window rule: which blocks a query reads
    cut_tables, cut_lens, starts = [], [], []
    for table, length in zip(decode_block_tables, decode_seq_lens):
        first = rule.first_needed_block(length - 1)  # the first block the query at length - 1 reads
        cut_tables.append(table[first:])
        cut_lens.append(length - first * block_size)
        starts.append(max(0, length - window) - first * block_size)
    groups = []
    for start, end in padding_runs([len(t) for t in cut_tables]):
        tables = cut_tables[start:end]
        max_blocks = max(len(t) for t in tables)
        dbt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long, device=device)
        positions = torch.arange(max_blocks * block_size, device=device)
        lens = torch.tensor(cut_lens[start:end], dtype=torch.long, device=device)
        lo = torch.tensor(starts[start:end], dtype=torch.long, device=device)
        mask = ((positions[None, :] < lens[:, None]) & (positions[None, :] >= lo[:, None]))[:, None, None, :]
        first = None
        if end - start == 1 and tables[0] == list(range(tables[0][0], tables[0][0] + max_blocks)):
            first = tables[0][0]
        groups.append(DecodeGroup(start, end, dbt, mask, max(cut_lens[start:end]), first))
    prefills, start = [], len(decode_block_tables)
    for num_computed, num_new, table in prefill_chunks:
        end = num_computed + num_new
        block_table = mask = None
        if num_computed > 0 or end > window:
            first = rule.first_needed_block(num_computed) if num_computed > 0 else 0
            q_pos = torch.arange(num_computed, end, device=device)
            k_pos = torch.arange(first * block_size if num_computed > 0 else 0, end, device=device)
            mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
            if num_computed > 0:
                block_table = torch.tensor(table[first:-(-end // block_size)], dtype=torch.long, device=device)
        prefills.append(PrefillChunk(start, start + num_new, block_table, mask))
        start += num_new
    return AttentionMetadata(slot_mapping, len(decode_block_tables), groups, prefills, window=window)
