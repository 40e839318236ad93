"""A step's short prefill chunks attended as decodes: one query row per token over the request's block table.

A chunk of a few new tokens after a cached context (a decode row verifying speculative drafts, a prompt's
last tokens after a prefix hit) is causal attention in which the query at position ``p`` attends positions
``0..p``: exactly ``p + 1`` tokens of context, as a decode at ``p`` would. A backend that reads block tables
itself (:class:`goodserve.models.attention.NativeAttentionBackend`) attends all of a step's such tokens in one
call of its decode kernel instead of gathering each chunk's context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

#: Chunks of at most this many new tokens after a cached context are :class:`ShortRows`. On the CPU the
#: decode kernel reads the context in place, where the chunk path gathers it and repeats it per query head
#: (BENCHMARKS.md, "Speculative decoding on the AVX-512 host").
MAX_SHORT_CHUNK = 16


@dataclass
class ShortRows:
    """The short chunks' tokens as decode queries (:data:`MAX_SHORT_CHUNK`).

    Attributes:
        index: ``[num_rows]`` int64 positions of the tokens in the flat batch.
        block_tables: ``[num_rows, max_blocks]`` int32, each token's request's block table, padded with 0.
        seq_lens: ``[num_rows]`` int32, each token's position + 1 (what it attends to).
        max_len: The longest of ``seq_lens``.
    """

    index: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    max_len: int


def short_rows(short: list[tuple[int, int, int, list[int]]], device: torch.device) -> Optional[ShortRows]:
    """:class:`ShortRows` of the chunks ``(flat start, num_computed, num_new, block table)``; ``None`` for none."""
    if not short:
        return None
    index, tables, lens = [], [], []
    for start, num_computed, num_new, table in short:
        index.extend(range(start, start + num_new))
        tables.extend([table] * num_new)
        lens.extend(range(num_computed + 1, num_computed + num_new + 1))
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    return ShortRows(torch.tensor(index, dtype=torch.long, device=device), padded,
                     torch.tensor(lens, dtype=torch.int32, device=device), max(lens))
