"""Attention over the paged KV cache for a mixed batch of decodes and prefill chunks.

The cache of one layer is two tensors ``[num_blocks, block_size, num_kv_heads, head_dim]`` (PagedAttention,
Kwon et al. 2023, §4.1): a token at position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``. A step first writes the new K/V into their
slots (``slot_mapping``), then lets every query attend to all earlier tokens of its own request.

The batch is laid out decodes first, then prefill chunks (``AttentionMetadata.build`` does the ordering
contract with the model runner). Decodes, sorted by context length, are cut into groups of bounded
padding and each group is attended in one vectorised call over its gathered, masked context; each prefill
chunk is attended on its own, causally, over its cached context plus its own tokens — a chunk with no
cached context never touches the cache for reading.

A cache may be int8 (``--kv-cache-dtype int8``): ``[num_blocks, block_size, num_kv_heads, head_dim + 4]``,
each row its codes and float32 scale (:mod:`goodserve.models.kv_quant`). New K/V are quantised as they are
written; the torch reference dequantizes only the context it gathers for a step, and the native kernel reads
the codes in place. A prefill chunk without cached context attends over its own unquantised K/V.

``AttentionBackend`` is the interface a fused kernel replaces; ``TorchAttentionBackend`` is the portable,
vectorised PyTorch reference, and ``NativeAttentionBackend`` attends decodes in place over the block table
with a CPU kernel (:mod:`goodserve.models.native`), prefill chunks as the reference does.
:func:`make_attention_backend` picks one for ``--attention-backend``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch
import torch.nn.functional as F

from goodserve.config import ATTENTION_BACKENDS
from goodserve.models import native
from goodserve.models.kv_quant import read_kv, write_kv
from goodserve.models.short_rows import MAX_SHORT_CHUNK, ShortRows, short_rows


@dataclass
class PrefillChunk:
    """One request's prefill (or recompute) chunk in the flat batch.

    Attributes:
        start: Index of its first token in the flat batch.
        end: One past its last token.
        block_table: ``[num_blocks_for_request]`` block ids, or ``None`` when the chunk has no cached context.
        mask: ``[num_new, num_computed + num_new]`` bool, True where a query may attend; ``None`` when the
            chunk has no cached context (plain causal attention).
        short: Its tokens are also in the step's :class:`ShortRows` (a backend that reads those attends
            them there).
    """

    start: int
    end: int
    block_table: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    short: bool = False


@dataclass
class DecodeGroup:
    """Decodes of similar context length, attended in one call (padded to the group's longest).

    Attributes:
        start: Index of its first token in the flat batch.
        end: One past its last token.
        block_tables: ``[end - start, max_blocks]`` int64, padded with block 0.
        mask: ``[end - start, 1, 1, max_blocks * block_size]`` bool, True on each request's ``seq_len``
            valid positions (the new token included); ``None`` for a group of one request, whose context is
            cut to its ``seq_len`` instead.
        seq_len: The longest context of the group, new token included.
        first_block: For a group of one request whose blocks are consecutive ids (a lone stream on a pool
            that hands out blocks in order), its first block: attention reads the cache in place.
    """

    start: int
    end: int
    block_tables: torch.Tensor
    mask: Optional[torch.Tensor]
    seq_len: int
    first_block: Optional[int] = None


# A decode group's padded blocks may exceed its real blocks by at most this factor: decodes are padded
# to the group's longest context, and on CPU the padded reads cost as much as real ones.
MAX_DECODE_PADDING = 1.25


def padding_runs(num_blocks: list[int], max_padding: float = MAX_DECODE_PADDING) -> list[tuple[int, int]]:
    """Cut decodes, in batch order, into ``[start, end)`` runs whose padding to the run's longest stays bounded:
    a run grows while ``count * longest <= max_padding * sum``; each run becomes one attention call."""
    runs, start, total, longest = [], 0, 0, 0
    for i, n in enumerate(num_blocks):
        if i > start and (i - start + 1) * max(longest, n) > max_padding * (total + n):
            runs.append((start, i))
            start, total, longest = i, 0, 0
        total += n
        longest = max(longest, n)
    if num_blocks:
        runs.append((start, len(num_blocks)))
    return runs


def group_decodes(num_blocks: list[int], max_padding: float = MAX_DECODE_PADDING) -> list[tuple[int, int]]:
    """:func:`padding_runs` of decodes sorted by block count ascending (sorted, the runs cut the least padding).

    Raises:
        ValueError: if ``num_blocks`` is not sorted ascending.
    """
    if any(a > b for a, b in zip(num_blocks, num_blocks[1:])):
        raise ValueError("decodes must be sorted by context length, shortest first")
    return padding_runs(num_blocks, max_padding)


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every layer's attention.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 cache slot of each token of the flat batch.
        num_decodes: The first ``num_decodes`` tokens are one decode each.
        decode_groups: The decodes, cut into groups of similar context length (empty when built for a
            backend that reads the block table itself).
        prefills: The prefill chunks that follow the decodes, in batch order.
        decode_block_tables: ``[num_decodes, max_blocks]`` int32, each decode's block table padded with 0;
            ``None`` unless built with ``decode_groups=False``.
        decode_seq_lens: ``[num_decodes]`` int32 context length of each decode, its new token included;
            ``None`` unless built with ``decode_groups=False``.
        max_decode_len: The longest of ``decode_seq_lens`` (0 without decodes).
        row_block_tables: ``[num_tokens, max_blocks]`` int32, the block table of every token's request (a
            prefill chunk's tokens repeat theirs); ``None`` unless built with ``per_row=True``.
        row_seq_lens: ``[num_tokens]`` int32, every token's position + 1 (what it attends to); ``None``
            unless built with ``per_row=True``.
        max_row_len: The longest of ``row_seq_lens`` (0 unless built with ``per_row=True``).
        windowed: Per window ``W`` of the model's sliding layers, the metadata those layers attend with
            (:func:`goodserve.models.window_attention.build_windowed`); read through :meth:`for_window`.
        window: The window this metadata was built for (``None``: full attention).
        layer_metadata: With several KV-cache groups (:mod:`goodserve.kv_cache.layout`), per layer the metadata of
            its group (its own block tables and slot mapping); read through :meth:`for_layer`. ``None``: one
            group, every layer uses this metadata.
        short_rows: The short chunks' tokens as decode queries (built with ``decode_groups=False``; ``None``
            without short chunks). The chunks stay in ``prefills`` too, marked ``short``.
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    decode_block_tables: Optional[torch.Tensor] = None
    decode_seq_lens: Optional[torch.Tensor] = None
    max_decode_len: int = 0
    row_block_tables: Optional[torch.Tensor] = None
    row_seq_lens: Optional[torch.Tensor] = None
    max_row_len: int = 0
    windowed: dict[int, "AttentionMetadata"] = field(default_factory=dict)
    window: Optional[int] = None
    layer_metadata: Optional[list["AttentionMetadata"]] = None
    short_rows: Optional[ShortRows] = None

    def for_layer(self, layer: int) -> "AttentionMetadata":
        """The metadata layer ``layer`` attends with: its KV-cache group's (``self`` with one group)."""
        return self if self.layer_metadata is None else self.layer_metadata[layer]

    def for_window(self, window: Optional[int]) -> "AttentionMetadata":
        """The metadata a layer attending within ``window`` tokens uses (``self`` for full attention, or when built
        for that window).

        Raises:
            RuntimeError: if the step was not built for that window (attending without it would be wrong).
        """
        if window == self.window:
            return self
        meta = self.windowed.get(window)
        if meta is None:
            raise RuntimeError(f"no attention metadata for a sliding window of {window} tokens in this step")
        return meta

    @classmethod
    def build(cls, block_size: int, decode_block_tables: list[list[int]], decode_seq_lens: list[int],
              prefill_chunks: list[tuple[int, int, list[int]]], slot_mapping: torch.Tensor,
              device: torch.device, decode_groups: bool = True, per_row: bool = False) -> "AttentionMetadata":
        """Build the metadata from plain lists.

        Args:
            block_size: Tokens per block.
            decode_block_tables: Block table of each decode request (trimmed to its context), in batch
                order, sorted by length ascending.
            decode_seq_lens: Context length of each decode request including its new token.
            prefill_chunks: ``(num_computed_tokens, num_new_tokens, block_table)`` of each prefill chunk,
                in batch order after the decodes.
            slot_mapping: ``[num_tokens]`` slots, decodes first.
            device: Where the tensors live.
            decode_groups: Cut the decodes into :class:`DecodeGroup` s (for :class:`TorchAttentionBackend`);
                ``False``: give them as one padded block table instead (``decode_block_tables``), and the
                short chunks' tokens as :class:`ShortRows`.
            per_row: Also give every token its own block table and context length (``row_block_tables``,
                ``row_seq_lens``), for a backend that attends each token alone (batch-invariant); the
                decodes' tables are then the first rows of those.
        """
        if per_row:
            return cls._build_per_row(block_size, decode_block_tables, decode_seq_lens, prefill_chunks,
                                      slot_mapping, device)
        num_decodes = len(decode_block_tables)
        groups = []
        tables = seq_lens = None
        if not decode_groups and num_decodes:
            max_blocks = max(len(t) for t in decode_block_tables)
            tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in decode_block_tables],
                                  dtype=torch.int32, device=device)
            seq_lens = torch.tensor(decode_seq_lens, dtype=torch.int32, device=device)
        for start, end in group_decodes([len(t) for t in decode_block_tables]) if decode_groups else []:
            group = decode_block_tables[start:end]
            max_blocks = len(group[-1])
            dbt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in group], dtype=torch.long, device=device)
            mask = first = None
            if end - start > 1:
                lens = torch.tensor(decode_seq_lens[start:end], dtype=torch.long, device=device)
                positions = torch.arange(max_blocks * block_size, device=device)
                mask = (positions[None, :] < lens[:, None])[:, None, None, :]
            elif group[0] == list(range(group[0][0], group[0][0] + max_blocks)):
                first = group[0][0]
            groups.append(DecodeGroup(start, end, dbt, mask, max(decode_seq_lens[start:end]), first))
        prefills = []
        short: list[tuple[int, int, int, list[int]]] = []  # (flat start, num_computed, num_new, table)
        start = num_decodes
        for num_computed, num_new, table in prefill_chunks:
            block_table = mask = None
            is_short = not decode_groups and 0 < num_computed and num_new <= MAX_SHORT_CHUNK
            if num_computed > 0:
                used = table[: (num_computed + num_new + block_size - 1) // block_size]
                block_table = torch.tensor(used, dtype=torch.long, device=device)
                q_pos = torch.arange(num_computed, num_computed + num_new, device=device)
                k_pos = torch.arange(num_computed + num_new, device=device)
                mask = k_pos[None, :] <= q_pos[:, None]
                if is_short:
                    short.append((start, num_computed, num_new, used))
            prefills.append(PrefillChunk(start, start + num_new, block_table, mask, is_short))
            start += num_new
        return cls(slot_mapping, num_decodes, groups, prefills, tables, seq_lens, max(decode_seq_lens, default=0),
                   short_rows=short_rows(short, device))


    @classmethod
    def _build_per_row(cls, block_size: int, decode_block_tables: list[list[int]], decode_seq_lens: list[int],
                       prefill_chunks: list[tuple[int, int, list[int]]], slot_mapping: torch.Tensor,
                       device: torch.device) -> "AttentionMetadata":
        """:meth:`build` with ``per_row=True``: one table row and one context length per token."""
        tables = list(decode_block_tables)
        lens = list(decode_seq_lens)
        repeats = [1] * len(tables)
        for num_computed, num_new, table in prefill_chunks:
            end = num_computed + num_new
            tables.append(table[: -(-end // block_size)])
            repeats.append(num_new)
            lens.extend(range(num_computed + 1, end + 1))
        width = max((len(t) for t in tables), default=0)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        rows = padded.repeat_interleave(torch.tensor(repeats), dim=0) if prefill_chunks else padded
        rows = rows.contiguous().to(device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        num_decodes = len(decode_block_tables)
        prefills, start = [], num_decodes
        for _, num_new, _ in prefill_chunks:
            prefills.append(PrefillChunk(start, start + num_new, None, None))
            start += num_new
        decode_tables = rows[:num_decodes] if num_decodes else None
        return cls(slot_mapping, num_decodes, [], prefills, decode_tables,
                   seq_lens[:num_decodes] if num_decodes else None, max(decode_seq_lens, default=0),
                   rows, seq_lens, max(lens, default=0))


class AttentionBackend(Protocol):
    """Computes one layer's attention over the paged cache; a fused kernel implements the same call."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Write ``k``/``v`` into the cache and attend.

        Args:
            q: ``[num_tokens, num_heads, head_dim]``.
            k: ``[num_tokens, num_kv_heads, head_dim]``.
            v: ``[num_tokens, num_kv_heads, head_dim]``.
            k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model's dtype, or int8
                ``[..., head_dim + 4]`` (:mod:`goodserve.models.kv_quant`), written in place.
            v_cache: same shape as ``k_cache``.
            meta: The step's metadata.

        Returns:
            ``[num_tokens, num_heads, head_dim]`` attention output.
        """
        ...


def gather_rows(cache: torch.Tensor, block_table: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Read blocks into a contiguous run, token-major.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_table: ``[..., nb]`` block ids.
        out: A flat buffer of at least ``block_table.numel() * block_size * num_kv_heads * head_dim``
            elements to gather into (reused across layers and steps: a fresh multi-MB tensor per call costs
            its page faults, which at long context cost as much as the copy itself).

    Returns:
        ``[..., nb * block_size, num_kv_heads, head_dim]``, contiguous: one ``index_select`` copy, which
        is about ten times faster on CPU than advanced indexing of the 4-D cache.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    index = block_table.reshape(-1)
    if out is None:
        rows = cache.view(num_blocks, -1).index_select(0, index)
    else:
        rows = out[:index.numel() * block_size * num_kv_heads * head_dim].view(index.numel(), -1)
        torch.index_select(cache.view(num_blocks, -1), 0, index, out=rows)
    ctx = block_table.shape[-1] * block_size
    return rows.view(*block_table.shape[:-1], ctx, num_kv_heads, head_dim)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """:func:`gather_rows` as a head-major view: ``[..., num_kv_heads, nb * block_size, head_dim]``."""
    return gather_rows(cache, block_table).transpose(-3, -2)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One query token per request over its gathered context, in one fused attention call.

    Grouped-query attention (Ainslie et al. 2023) without repeating K/V: the ``num_heads // num_kv_heads``
    query heads that share a KV head become that head's query rows, so one
    ``scaled_dot_product_attention`` call (PyTorch's fused CPU kernel) streams each KV head once. On the
    default model a layer's decode attention is 1.3-2.7x faster than with the two batched matmuls this
    replaces (BENCHMARKS.md, issue 15, run 4).

    Args:
        q: ``[n, num_heads, head_dim]``.
        k: ``[n, ctx, num_kv_heads, head_dim]`` (token-major, as gathered from the cache).
        v: ``[n, ctx, num_kv_heads, head_dim]``.
        mask: ``[n, 1, 1, ctx]`` bool, True on valid positions; ``None`` when every position is valid.

    Returns:
        ``[n, num_heads, head_dim]``.
    """
    n, ctx, num_kv_heads, head_dim = k.shape
    num_heads = q.shape[1]
    queries = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(queries, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.reshape(n, num_heads, head_dim)


class TorchAttentionBackend:
    """Portable paged attention with ``torch.nn.functional.scaled_dot_product_attention``.

    Prefill chunks are shaped so that PyTorch's fused CPU kernel (flash attention for CPU) takes them rather
    than the unfused math path, which is several times slower: 4-D inputs and no ``enable_gqa``, K/V
    repeated per query head (a copy linear in the chunk, small next to its attention). Decodes, one query
    per request, use :func:`decode_attention`, the same kernel with a KV head's query heads as its rows.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def _buffer(self, name: str, like: torch.Tensor, numel: int) -> torch.Tensor:
        """A flat scratch tensor of at least ``numel`` elements, kept and grown (x1.5) across calls."""
        key = (name, like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            size = max(numel, int(buf.numel() * 1.5) if buf is not None else 0)
            buf = self._buffers[key] = torch.empty(size, dtype=like.dtype, device=like.device)
        return buf

    def _decode_context(self, cache: torch.Tensor, g: DecodeGroup, name: str, dtype: torch.dtype) -> torch.Tensor:
        """``[n, ctx, num_kv_heads, head_dim]`` context of a decode group: the cache itself when the group is
        one request on consecutive blocks, else gathered into a reused buffer; a lone request's is cut to its
        ``seq_len`` (its group has no mask). An int8 cache's context is dequantized to ``dtype`` once gathered."""
        _, block_size, num_kv_heads, head_dim = cache.shape
        n, nb = g.block_tables.shape
        if g.first_block is not None:
            ctx = cache[g.first_block:g.first_block + nb].view(1, nb * block_size, num_kv_heads, head_dim)
        else:
            ctx = gather_rows(cache, g.block_tables, self._buffer(name, cache, cache[0].numel() * n * nb))
        ctx = ctx if g.mask is not None else ctx[:, :g.seq_len]
        return read_kv(ctx, dtype)

    #: Whether the backend attends decodes by :class:`DecodeGroup` (else by ``decode_block_tables``).
    uses_decode_groups = True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k_cache, meta.slot_mapping, k)
        write_kv(v_cache, meta.slot_mapping, v)
        decoded = self._decodes(q[:meta.num_decodes], k_cache, v_cache, meta)
        if not meta.prefills and decoded is not None:
            return decoded
        out = torch.empty_like(q)
        if decoded is None:
            self._decodes_into(out, q, k_cache, v_cache, meta)
        else:
            out[:meta.num_decodes] = decoded
        self._prefills_into(out, q, k, v, k_cache, v_cache, meta)
        return out

    def _decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> Optional[torch.Tensor]:
        """``[num_decodes, num_heads, head_dim]`` when the decodes come out as one tensor without a copy (one
        group), else ``None`` (then :meth:`_decodes_into` writes them)."""
        if len(meta.decode_groups) != 1:  # none, or several
            return None
        g = meta.decode_groups[0]
        return decode_attention(q, self._decode_context(k_cache, g, "k", q.dtype),
                                self._decode_context(v_cache, g, "v", q.dtype), g.mask)

    def _decodes_into(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata) -> None:
        for g in meta.decode_groups:
            kd = self._decode_context(k_cache, g, "k", q.dtype)  # [n, ctx, num_kv_heads, head_dim]
            vd = self._decode_context(v_cache, g, "v", q.dtype)
            out[g.start:g.end] = decode_attention(q[g.start:g.end], kd, vd, g.mask)

    def _prefills_into(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       skip_short: bool = False) -> None:
        """Each prefill chunk's attention into ``out`` (``skip_short``: but the chunks marked ``short``)."""
        group = q.shape[1] // k_cache.shape[2]
        for chunk in meta.prefills:
            if skip_short and chunk.short:
                continue
            qp = q[chunk.start:chunk.end].transpose(0, 1)[None]  # [1, num_heads, n, head_dim]
            if chunk.block_table is None:  # no cached context: its own tokens (a window's mask, if any)
                kp = k[chunk.start:chunk.end].transpose(0, 1)  # [num_kv_heads, n, head_dim]
                vp = v[chunk.start:chunk.end].transpose(0, 1)
            else:
                ctx = chunk.mask.shape[1]
                kp = _gather(k_cache, chunk.block_table)[:, :ctx]  # [num_kv_heads, ctx, head_dim (+ 4 for int8)]
                vp = _gather(v_cache, chunk.block_table)[:, :ctx]
                kp, vp = read_kv(kp, q.dtype), read_kv(vp, q.dtype)
            kp = kp.repeat_interleave(group, dim=0)[None]  # [1, num_heads, ctx, head_dim]
            vp = vp.repeat_interleave(group, dim=0)[None]
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, is_causal=chunk.mask is None)
            out[chunk.start:chunk.end] = op[0].transpose(0, 1)


class NativeAttentionBackend(TorchAttentionBackend):
    """Decodes attended in place over the block table by the CPU kernel of :mod:`goodserve.models.native`
    (no gathered copy of the context); prefill chunks as :class:`TorchAttentionBackend`.

    Raises:
        RuntimeError: at construction, if the kernel cannot be built or loaded on this machine.
    """

    uses_decode_groups = False

    def __init__(self) -> None:
        super().__init__()
        if not native.load():
            raise RuntimeError("the native attention kernel is not available on this machine "
                               "(no C++ compiler, a failed build, or GOODSERVE_NATIVE_KERNELS=0)")

    def _decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> Optional[torch.Tensor]:
        if meta.num_decodes == 0:
            return None
        if meta.decode_block_tables is None:  # metadata in decode groups (a sliding window's): the torch path
            return super()._decodes(q, k_cache, v_cache, meta)
        return native.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                             meta.max_decode_len)

    def _prefills_into(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       skip_short: bool = False) -> None:
        """The short chunks' tokens as decode queries in one kernel call (:class:`ShortRows`), the others as
        :class:`TorchAttentionBackend` attends them."""
        rows = meta.short_rows
        if rows is not None:
            got = native.paged_decode_attention(q.index_select(0, rows.index), k_cache, v_cache, rows.block_tables,
                                                rows.seq_lens, rows.max_len)
            out.index_copy_(0, rows.index, got)
        super()._prefills_into(out, q, k, v, k_cache, v_cache, meta, skip_short=rows is not None)


def make_attention_backend(name: str, device: torch.device, batch_invariant: bool = False) -> AttentionBackend:
    """The backend ``--attention-backend name`` selects for a model on ``device``; with ``batch_invariant``,
    its batch-invariant form (:class:`goodserve.models.invariant_attention.InvariantAttentionBackend`).

    Raises:
        ValueError: on an unknown name, or ``native`` on a device other than the CPU.
        RuntimeError: for ``native`` where the kernel cannot be built.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "native" and device.type != "cpu":
        raise ValueError(f"the native attention backend runs on the CPU only, not on {device.type}")
    if batch_invariant:
        from goodserve.models.invariant_attention import InvariantAttentionBackend

        return InvariantAttentionBackend(name == "native" or (name == "auto" and native.load()))
    if name == "native" or (name == "auto" and device.type == "cpu" and native.load()):
        return NativeAttentionBackend()
    return TorchAttentionBackend()
