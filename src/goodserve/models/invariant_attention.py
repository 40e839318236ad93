"""Batch-invariant paged attention: every token, decode or prefill, attends alone over its own context.

A token's attention output must not depend on its batch, on whether it is computed in a prefill chunk, as a
decode, after a prefix hit (its prompt's head read from the cache) or after a preemption (recomputed). Two
kernels (a prefill kernel and a decode kernel) sum in different orders, and a decode kernel that splits a
context by the batch's size (flash-decoding) changes a row's order with its neighbours. Here one function
serves every token: its K/V are written to the cache first, then each token's query reads positions
``[0, position]`` of its request from the cache, in splits of :data:`SPLIT_TOKENS` counted from position 0,
merged in order (the online softmax of flash attention, Dao et al. 2022; flash-decoding's merge, Dao et al.
2023). A split past a token's length is empty and merges as an exact no-op.

* native, bfloat16 on AMX (``csrc/paged_attention_amx.cpp``): a prefill chunk's consecutive tokens share
  the K and V tiles of their context (runs of up to ``16 // group`` tokens), each token's output computed
  from its own query row alone, in chunks of 32 positions; a decode is a run of one.
* native otherwise: :func:`goodserve.models.native.paged_decode_attention` with fixed splits, one row per
  token.
* torch: the same arithmetic plan in float32 eager ops whose reductions run in a fixed order: sums as the
  last element of a ``cumsum`` (a sequential scan), maxima exactly.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from goodserve.models import native
from goodserve.models.attention import AttentionMetadata
from goodserve.models.invariant import sequential_sum as _sum
from goodserve.models.kv_quant import write_kv

#: Tokens of one split of a context (splits start at position 0, so a token's splits depend on its length only).
SPLIT_TOKENS = 256
#: Query rows the torch path computes at once (bounds its float32 temporaries).
TORCH_ROWS = 64


class InvariantAttentionBackend:
    """Attention whose output for a token depends on that token's query and context alone.

    Args:
        use_native: Run :func:`goodserve.models.native.paged_decode_attention` (CPU, kernels built);
            ``False``: the torch path.

    Raises:
        RuntimeError: if ``use_native`` and the native kernels are not available.
    """

    uses_decode_groups = False
    #: The runner builds :class:`AttentionMetadata` with ``per_row=True`` for this backend.
    uses_row_tables = True

    def __init__(self, use_native: bool) -> None:
        if use_native and not native.load():
            raise RuntimeError("the native attention kernel is not available on this machine")
        self.use_native = use_native
        self.amx = use_native and amx_attention_available()

    def uses_amx(self, q: torch.Tensor, num_kv_heads: int) -> bool:
        """Whether rows like ``q`` (``[rows, num_heads, head_dim]``) run on the AMX kernel."""
        heads, head_dim = q.shape[1], q.shape[2]
        return (self.amx and q.dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256
                and heads // num_kv_heads <= 16)

    def run_positions(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> Optional[int]:
        """The most positions of a row one attention run holds on this backend (:func:`run_starts`): ``16 //
        (num_heads // num_kv_heads)`` on the AMX kernel, each further run attending the context again; ``None``
        elsewhere (a row's positions attend apart, or all at once)."""
        q = torch.empty((0, num_heads, head_dim), dtype=dtype, device="meta")
        return run_rows(num_heads // num_kv_heads) if self.uses_amx(q, num_kv_heads) else None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Write ``k``/``v`` into the cache, then attend every token over its context (see
        :class:`~goodserve.models.attention.AttentionBackend` for the shapes)."""
        if k_cache.dtype != q.dtype:
            raise RuntimeError(f"batch-invariant attention is not implemented for a {k_cache.dtype} KV cache under "
                               f"{q.dtype} activations (--batch-invariant refuses a --kv-cache-dtype other than "
                               "--dtype)")
        write_kv(k_cache, meta.slot_mapping, k)
        write_kv(v_cache, meta.slot_mapping, v)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        if self.uses_amx(q, k_cache.shape[2]):
            return attention_rows_amx(q, k_cache, v_cache, meta)
        if self.use_native:
            return native.paged_decode_attention(q, k_cache, v_cache, meta.row_block_tables, meta.row_seq_lens,
                                                 meta.max_row_len, split_tokens=SPLIT_TOKENS)
        out = torch.empty_like(q)
        for start in range(0, q.shape[0], TORCH_ROWS):
            end = min(start + TORCH_ROWS, q.shape[0])
            out[start:end] = _attend_torch(q[start:end], k_cache, v_cache, meta.row_block_tables[start:end],
                                           meta.row_seq_lens[start:end])
        return out


def amx_attention_available() -> bool:
    """Whether the AMX attention kernel runs here (the native kernels built, AMX granted by the OS)."""
    return bool(native.load() and torch.ops.goodserve.paged_attention_rows_supported())


def run_rows(group: int) -> int:
    """The most of a chunk's tokens one run of the AMX kernel holds: its 16 query rows a tile over ``group``
    query heads a KV head."""
    return max(1, 16 // group)


def run_starts(meta: AttentionMetadata, group: int) -> torch.Tensor:
    """``[num_runs + 1]`` int32 first row of each run: every decode alone, each prefill chunk's tokens in
    runs of :func:`run_rows` (they share a block table)."""
    per_run = run_rows(group)
    starts = list(range(meta.num_decodes))
    for chunk in meta.prefills:
        starts.extend(range(chunk.start, chunk.end, per_run))
    starts.append(meta.row_seq_lens.shape[0])
    return torch.tensor(starts, dtype=torch.int32)


def attention_rows_amx(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
    """``[rows, num_heads, head_dim]`` bfloat16 attention of every row on the AMX kernel (the caches already
    hold the step's K/V).

    Raises:
        RuntimeError: if the kernel refuses the call. ValueError: on layouts it does not take.
    """
    rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous and each query row's heads contiguous")
    return torch.ops.goodserve.paged_attention_rows(
        q, k_cache, v_cache, meta.row_block_tables, meta.row_seq_lens, run_starts(meta, num_heads // num_kv_heads),
        SPLIT_TOKENS, -(-meta.max_row_len // SPLIT_TOKENS), 1.0 / math.sqrt(head_dim))


def _attend_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  seq_lens: torch.Tensor) -> torch.Tensor:
    """``[rows, num_heads, head_dim]`` attention of each row over its first ``seq_lens[i]`` positions."""
    rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    qf = q.float().view(rows, 1, num_kv_heads, group, head_dim) * (1.0 / math.sqrt(head_dim))
    lens = seq_lens.long()
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    m = torch.full((rows, num_kv_heads, group), -math.inf)
    total = torch.zeros((rows, num_kv_heads, group))
    acc = torch.zeros((rows, num_kv_heads, group, head_dim))
    max_len = int(lens.max())
    for s0 in range(0, max_len, SPLIT_TOKENS):
        pos = torch.arange(s0, s0 + SPLIT_TOKENS)  # [S]
        valid = pos[None, :] < lens[:, None]  # [rows, S]
        block = (pos // block_size).clamp(max=tables.shape[1] - 1)
        slots = tables.long()[:, block] * block_size + pos % block_size  # [rows, S]
        slots = torch.where(valid, slots, 0)
        kc = flat_k[slots].float()  # [rows, S, num_kv_heads, head_dim]
        vc = flat_v[slots].float()
        scores = _sum(qf * kc[:, :, :, None, :], -1)  # [rows, S, num_kv_heads, group]
        scores = scores.masked_fill(~valid[:, :, None, None], -math.inf)
        m_new = torch.maximum(m, scores.amax(dim=1))
        safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows with nothing yet: no NaN from -inf - -inf
        alpha = torch.exp(m - safe)  # exp(-inf) = 0 for an empty history, 1 when the max is unchanged
        p = torch.exp(scores - safe[:, None])  # [rows, S, num_kv_heads, group]
        total = total * alpha + _sum(p, 1)
        acc = acc * alpha[..., None] + _sum(p[..., None] * vc[:, :, :, None, :], 1)
        m = m_new
    return (acc / total[..., None]).to(q.dtype).view(rows, num_heads, head_dim)
