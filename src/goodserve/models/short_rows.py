"""A step's short prefill chunks attended as decodes: one query row per token over the request's block table.

A chunk of a few new tokens after a cached context (a decode row verifying speculative drafts, a prompt's
last tokens after a prefix hit) is causal attention in which the query at position ``p`` attends positions
``0..p``: exactly ``p + 1`` tokens of context, as a decode at ``p`` would. A backend that reads block tables
itself (:class:`goodserve.models.attention.NativeAttentionBackend`) attends all of a step's such tokens in one
call of its decode kernel instead of gathering each chunk's context; a step of decodes and such chunks alone
runs as decode rows (:func:`as_decode_rows`, :func:`decode_rows`) in the one-call decode step
(:meth:`goodserve.models.llama.LlamaForCausalLM.decode_in_one_call`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from goodserve.models.attention import AttentionMetadata

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


def as_decode_rows(meta: "AttentionMetadata", num_tokens: int) -> bool:
    """Whether every token of the step is a decode or a :class:`ShortRows` token, so that the step can run as
    ``num_tokens`` decode rows (:func:`decode_rows`). With the batch-invariant backend's ``per_row`` tables, where
    every token already attends alone over its own table as a decode would, every step qualifies (a chunk's
    tokens then attend in the runs the layer-by-layer path gives them,
    :func:`goodserve.models.invariant_attention.run_starts`, reading their context once a run). Metadata with
    decode groups qualifies only for a step of decodes alone given as ``decode_block_tables``."""
    if num_tokens < 1:
        return False
    if meta.row_block_tables is not None:
        return True
    rows = meta.short_rows
    num_short = 0 if rows is None else rows.seq_lens.shape[0]
    if meta.num_decodes + num_short != num_tokens:
        return False
    return meta.num_decodes == 0 or meta.decode_block_tables is not None


def decode_rows(meta: "AttentionMetadata") -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each token of a step that :func:`as_decode_rows` takes as one decode query, in the flat token order.

    The decodes come first, then the short chunks' tokens in order (the chunks follow the decodes, and
    every chunk is short), so the rows are the decodes' followed by :class:`ShortRows`' (with ``per_row``
    tables, those tables themselves). A chunk's token at position ``p`` attends ``p + 1`` tokens: its chunk's
    earlier tokens too, which a kernel that writes every row's K/V before it attends (``csrc/decode_step.cpp``)
    has in the cache by then.

    Returns:
        ``block_tables`` ``[num_tokens, max_blocks]`` int32 (each token's request's table, padded with 0),
        ``seq_lens`` ``[num_tokens]`` int32 (position + 1), and their maximum.
    """
    if meta.row_block_tables is not None:
        return meta.row_block_tables, meta.row_seq_lens, meta.max_row_len
    rows = meta.short_rows
    if rows is None:
        return meta.decode_block_tables, meta.decode_seq_lens, meta.max_decode_len
    if meta.num_decodes == 0:
        return rows.block_tables, rows.seq_lens, rows.max_len
    tables = meta.decode_block_tables
    width = max(tables.shape[1], rows.block_tables.shape[1])
    padded = [t if t.shape[1] == width else torch.nn.functional.pad(t, (0, width - t.shape[1]))
              for t in (tables, rows.block_tables)]
    return (torch.cat(padded), torch.cat([meta.decode_seq_lens, rows.seq_lens]),
            max(meta.max_decode_len, rows.max_len))
