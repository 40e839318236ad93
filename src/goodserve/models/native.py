"""Native CPU kernels, called as torch ops.

- :func:`paged_decode_attention`: PyTorch has no CPU kernel that attends over a paged KV cache in place, so
  the portable backend gathers every decode's context into a contiguous copy first (``models/attention.py``);
  at batch 16 and 384 tokens of context that copy and the attention after it were a third of a decode step
  of the default model. The kernel reads the blocks where they are.
- :func:`rms_norm` (with the residual add before it) and :func:`rope`: at decode sizes each is several eager
  ops of a few microseconds of dispatch, more than their arithmetic, ~180 calls per step of the default
  model; here each is one call, rounded as the ops it replaces.
- :func:`block_gemv`: ``x W^T`` for a few rows with ``W`` in the GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 or K-quant
  blocks and ``x`` quantized to int16 per block of 32, on AVX-512 VNNI or AVX2: at batch 1 the
  decode step is a read of every weight, and this reads the file's bytes once, at the memory's rate.
  :func:`block_gemv_grouped` runs a mixture of experts' step, each expert over its rows, in one call.
- :func:`goodserve.models.native_decode.decode_layers`: a decode step of 1-8 rows through every layer in one
  call, on the kernels above, for a model whose projections all run on :func:`block_gemv` (more rows on the
  batch-invariant GEMM: :mod:`goodserve.models.decode_plans`): at batch 1 the
  eager step spent about as long dispatching ~15 ops per layer as computing them.
- :func:`argmax`: greedy sampling. PyTorch's CPU argmax over a batch's logits cost ~10x a max over the same
  rows (4.3-7.8 ms at batch 64, 49,152 tokens).

Each kernel is a torch op, ``torch.ops.goodserve.<name>`` (schemas in ``csrc/torch_bindings.cpp``, built at
install by :mod:`goodserve.models.native_build`), so ``torch.profiler`` shows it by name and ``torch.compile``
sees it through its fake implementation (:mod:`goodserve.models.native_fake`). The wrappers here check
shapes, dtypes and layouts and raise ``ValueError`` naming what is wrong; :func:`load` says whether the ops
are there (``False`` with one warning where they cannot be built; ``GOODSERVE_NATIVE_KERNELS=0`` turns them
off), and the engine then runs on PyTorch ops.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from goodserve.kv_cache.spec import INT8_SCALE_BYTES
from goodserve.models.native_build import load

__all__ = ["load"]  # with the wrappers below

#: A split of a request's context holds at least this many tokens (smaller ones cost more to merge).
MIN_SPLIT_TOKENS = 256

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _ops(x: torch.Tensor):
    """``torch.ops.goodserve`` for a call on ``x``.

    Raises:
        RuntimeError: if the kernels are not built or ``x`` is not on the CPU.
    """
    if not load() or x.device.type != "cpu":
        raise RuntimeError("the native kernels are not available (they run on the CPU where they build)")
    return torch.ops.goodserve


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels take tensors like ``x``: on the CPU, float32 or bfloat16, the library built."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and load()


def usable(x: torch.Tensor) -> bool:
    """Whether :func:`rms_norm`, :func:`rope` and :func:`silu_mul` run for tensors like ``x`` (:func:`supports`)."""
    return supports(x)


def num_splits(num_seqs: int, max_len: int, num_threads: int) -> int:
    """Splits of each request's context: enough work items (a request's split, all its KV heads) for every
    thread, 4 per thread, each split at least :data:`MIN_SPLIT_TOKENS` long."""
    if num_seqs >= 4 * num_threads:
        return 1
    return max(1, min(math.ceil(max_len / MIN_SPLIT_TOKENS), math.ceil(4 * num_threads / num_seqs)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                           scale: Optional[float] = None, split_tokens: Optional[int] = None) -> torch.Tensor:
    """Attention of one query token per request over its paged context, read in place.

    Args:
        q: ``[n, num_heads, head_dim]``; rows may be strided (e.g. a slice of a fused QKV output), each
            row's heads contiguous.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, same dtype as ``q``; or an
            int8 cache ``[num_blocks, block_size, num_kv_heads, head_dim + 4]``, each row its codes then its
            float32 scale (:mod:`goodserve.models.kv_quant`), read in place: ``q·k = scale_k · Σ q_d k_d`` and
            V accumulated as ``scale_v · v`` (on the kernel's portable path, not its AVX-512 variants); or a
            bfloat16 cache under a float32 ``q`` (widened element by element, on the portable path too).
        v_cache: same shape and dtype as ``k_cache``.
        block_tables: ``[n, max_blocks]`` int32; row ``i`` covers request ``i``'s ``seq_lens[i]`` tokens.
        seq_lens: ``[n]`` int32 context length of each request, its new token included (≥ 1).
        max_len: ``max(seq_lens)`` (known to the caller without a read of the tensor).
        scale: Softmax scale; default ``1 / sqrt(head_dim)``.
        split_tokens: Cut every context into splits of this many tokens from position 0 (batch-invariant:
            a row's arithmetic then depends on its own length only); default: splits sized by
            :func:`num_splits` for the batch.

    Returns:
        ``[n, num_heads, head_dim]``, ``q``'s dtype.

    Raises:
        RuntimeError: if the kernels are not available (see :func:`load`) or the kernel refuses the call.
        ValueError: on inconsistent shapes, dtypes or layouts.
    """
    ops = _ops(q)
    n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    mixed = q.dtype == torch.float32 and k_cache.dtype == torch.bfloat16
    cache_dtype = torch.int8 if k_cache.dtype == torch.int8 else torch.bfloat16 if mixed else q.dtype
    if q.dtype not in _DTYPES or k_cache.dtype != cache_dtype or v_cache.dtype != cache_dtype:
        raise ValueError(f"q and the caches must share a dtype among {list(_DTYPES)}, or the caches both be "
                         "int8 (rows with their scales), or bfloat16 under a float32 q")
    if cache_dtype == torch.int8:
        cache_head_dim -= INT8_SCALE_BYTES
    if cache_head_dim != head_dim or num_heads % num_kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError("q, k_cache and v_cache shapes disagree")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or q.stride(2) != 1 or q.stride(1) != head_dim:
        raise ValueError("the caches must be contiguous and each query row's heads contiguous")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.shape[0] != n \
            or seq_lens.shape != (n,) or not block_tables.is_contiguous():
        raise ValueError("block_tables must be [n, max_blocks] int32 and seq_lens [n] int32, contiguous")
    if n == 0:
        return torch.empty((0, num_heads, head_dim), dtype=q.dtype)
    if split_tokens is None:
        splits = num_splits(n, max_len, torch.get_num_threads())
        split_tokens = -(-max_len // splits)
    else:
        splits = -(-max_len // split_tokens)
    return ops.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, split_tokens, splits,
                                      scale if scale is not None else 1.0 / math.sqrt(head_dim))


def _rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} must be [rows, cols] with contiguous rows, got shape {tuple(x.shape)} "
                         f"and strides {x.stride()}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x + residual`` (Zhang and Sennrich 2019), as ``weight * F.rms_norm(h.float()).to(dtype)``.

    Args:
        x: ``[rows, hidden]``, rows contiguous (a row stride is allowed).
        weight: ``[hidden]``, ``x``'s dtype.
        eps: Added to the mean square.
        residual: ``[rows, hidden]`` or ``None``; added to ``x`` first (rounded to the dtype, as ``x + r``).

    Returns:
        ``(normed, h)``: ``[rows, hidden]`` each, ``h`` being ``x + residual`` (``x`` itself without one).

    Raises:
        RuntimeError: if the kernels are not available. ValueError: on a shape, layout or dtype mismatch.
    """
    ops = _ops(x)
    _rows(x, "x")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or weight.shape != (x.shape[1],) \
            or not weight.is_contiguous():
        raise ValueError(f"weight must be [{x.shape[1]}] contiguous and share x's dtype among {list(_DTYPES)}")
    if residual is not None:
        _rows(residual, "residual")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must have x's shape and dtype")
    out, h = ops.rms_norm(x, weight, eps, residual)
    return out, (x if residual is None else h)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head on its own (Qwen3's q/k norms): head ``h`` of every row as :func:`rms_norm`
    computes a row, times ``weight[h]``.

    Args:
        x: ``[rows, heads, head_dim]``, each row's heads contiguous (a row stride is allowed).
        weight: ``[heads, head_dim]``, ``x``'s dtype, contiguous.
        eps: Added to the mean square.

    Returns:
        ``[rows, heads, head_dim]``, contiguous, ``x``'s dtype.

    Raises:
        RuntimeError: if the kernels are not available. ValueError: on a shape, layout or dtype mismatch.
    """
    ops = _ops(x)
    if x.dtype not in _DTYPES or x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError("x must be [rows, heads, head_dim] float32 or bfloat16 with each row's heads contiguous")
    if weight.dtype != x.dtype or weight.shape != x.shape[1:] or not weight.is_contiguous():
        raise ValueError(f"weight must be {list(x.shape[1:])} contiguous in x's dtype")
    return ops.head_rms_norm(x, weight, eps)


def rope(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embeddings (Su et al. 2021, RoFormer §3.4): ``x * cos + rotate_half(x) * sin``.

    Args:
        x: ``[rows, heads, head_dim]``, each row's heads contiguous (a row stride is allowed).
        table: ``[2, max_positions, head_dim]`` cos then sin of every position, ``x``'s dtype, contiguous.
        positions: ``[rows]`` int64 position of each row, each ``< max_positions`` (not checked here: the
            engine caps ``max_model_len`` at the model's positions).

    Returns:
        ``[rows, heads, head_dim]``, contiguous, ``x``'s dtype.

    Raises:
        RuntimeError: if the kernels are not available. ValueError: on a shape, layout or dtype mismatch.
    """
    ops = _ops(x)
    rows, heads, head_dim = x.shape
    if x.dtype not in _DTYPES or table.dtype != x.dtype or not table.is_contiguous() or table.dim() != 3 \
            or table.shape[0] != 2 or table.shape[2] != head_dim:
        raise ValueError("table must be [2, max_positions, head_dim] contiguous in x's dtype")
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError("each row's heads of x must be contiguous")
    if positions.dtype != torch.int64 or positions.shape != (rows,) or not positions.is_contiguous():
        raise ValueError("positions must be [rows] int64, contiguous")
    return ops.rope(x, table, positions)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of ``[rows, 2 * inter]`` rows ``[gate | up]`` (``csrc/silu_mul.cpp``: the
    same bits as the one-call decode step's, rounded as the eager ops round).

    Returns:
        ``[rows, inter]``, contiguous, ``gate_up``'s dtype.

    Raises:
        RuntimeError: if the kernels are not available. ValueError: on a layout or dtype it does not take.
    """
    ops = _ops(gate_up)
    _rows(gate_up, "gate_up")
    if gate_up.dtype not in _DTYPES or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [rows, 2 * inter] float32 or bfloat16, got {gate_up.dtype} "
                         f"{tuple(gate_up.shape)}")
    return ops.silu_mul(gate_up)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``: the first index of each row's maximum, or of its first NaN.

    Args:
        x: ``[rows, cols]`` float32 or bfloat16, ``cols >= 1``, rows contiguous (a row stride is allowed).

    Returns:
        ``[rows]`` int64.

    Raises:
        RuntimeError: if the kernels are not available. ValueError: on a shape, layout or dtype it does not take.
    """
    ops = _ops(x)
    _rows(x, "x")
    if x.dtype not in _DTYPES or x.shape[1] < 1:
        raise ValueError(f"x must be float32 or bfloat16 with at least one column, got {x.dtype} {tuple(x.shape)}")
    return ops.argmax(x)


#: Rows of one pass of :func:`block_gemv` over its weight (a :class:`~goodserve.models.quant.QuantLinear` on
#: the kernel runs steps of up to this many rows on it).
BLOCK_GEMV_MAX_ROWS = 4
#: :func:`block_gemv`'s ``kind`` codes.
BLOCK_KINDS = {"Q4_0": 0, "Q4_1": 0, "Q8_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4, "Q5_0": 5, "Q5_1": 5}
# K-quants: bits of each code per weight in the packed codes, and the sub-block scales' dtype.
_K_CODE_BITS = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
_K_SUB_DTYPES = {"Q4_K": torch.uint8, "Q5_K": torch.uint8, "Q6_K": torch.int8}


def block_in_features(kind: str, scales: torch.Tensor) -> int:
    """``K`` of a :func:`block_gemv` weight from its ``scales`` operand: 32 weights per fp16 scale, 256 per
    super-block for the K-quants (two fp16 per super-block, ``d`` and ``dmin``, except Q6_K's one)."""
    if kind in _K_CODE_BITS:
        return scales.shape[1] // (1 if kind == "Q6_K" else 2) * 256
    return scales.shape[1] * 32


def block_gemv_usable(x: torch.Tensor) -> bool:
    """Whether :func:`block_gemv` runs for activations like ``x`` (:func:`supports`, and the library built
    with AVX-512 VNNI or AVX2)."""
    return supports(x) and torch.ops.goodserve.block_gemv_supported()


def blocks_run_in(dtype: torch.dtype) -> bool:
    """Whether ``--quantization auto`` runs a GGUF's blocks on :func:`block_gemv` under activations of ``dtype``:
    bfloat16, and float32 on a CPU where oneDNN has no bfloat16 path (AVX2 only), where float32 is
    ``--dtype auto``'s choice and the file's blocks are a fraction of float32 copies' bytes. Elsewhere float32
    is the precision mode, every weight dequantized, and so it is there when asked for by name
    (:func:`goodserve.engine.args.resolve_quantization`). The kernel itself takes either dtype."""
    from goodserve.models.linear import onednn_has_bfloat16

    return (dtype == torch.bfloat16 or (dtype == torch.float32 and not onednn_has_bfloat16())) \
        and block_gemv_usable(torch.empty(0, dtype=dtype))


def block_gemv_fits(n: int, k: int) -> bool:
    """Whether :func:`block_gemv` takes an ``[n, k]`` weight: ``k`` a multiple of 64 up to 16,384, ``n`` of 16."""
    return k % 64 == 0 and k <= 16384 and n % 16 == 0


def check_blocks(kind: str, codes: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor]) -> None:
    """Check a weight's operands for :func:`block_gemv` once (its calls check only the activations).

    Raises:
        ValueError: for shapes, dtypes or layouts outside the kernel's range (``K`` a multiple of 64 up to
        16,384, of 256 for the K-quants, ``N`` a multiple of 16).
    """
    n, k = scales.shape[0], block_in_features(kind, scales)
    if kind in _K_CODE_BITS:  # packed codes, fp16 super-block scales, 8-bit sub-block scales (and minimums)
        width, mins_ok = k * _K_CODE_BITS[kind] // 8, mins is not None and mins.dtype == _K_SUB_DTYPES[kind] \
            and mins.shape == (n, k // 16)
    else:  # 4-, 5- (Q5_0 / Q5_1: nibbles and a bit plane) or 8-bit codes, fp16 scales (and minimums)
        width = {0: k // 2, 1: k, 5: k * 5 // 8}[BLOCK_KINDS[kind]]
        mins_ok = mins is None or (mins.shape == scales.shape and mins.dtype == torch.float16)
    if codes.dtype != torch.uint8 or codes.shape != (n, width) or scales.dtype != torch.float16 or not mins_ok:
        raise ValueError(f"{kind} operands do not hold a [{n}, {k}] weight")
    if not (codes.is_contiguous() and scales.is_contiguous() and (mins is None or mins.is_contiguous())):
        raise ValueError("the weight's operands must be contiguous")
    if not block_gemv_fits(n, k):
        raise ValueError(f"block_gemv takes K a multiple of 64 up to 16384 and N a multiple of 16, got K={k}, N={n}")


def block_gemv(x: torch.Tensor, kind: str, codes: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor],
               offset: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``y = x W^T`` with ``W[n, 32 b + j] = scales[n, b] * (u - offset) + mins[n, b]`` (``u`` the code), or a
    K-quant's super-blocks, ``x`` quantized to int16 per row and block of 32 (``csrc/block_gemv.cpp`` states
    the arithmetic and the layouts).

    Args:
        x: ``[rows, K]``, float32 or bfloat16, rows contiguous (a row stride is allowed). Each group of
            :data:`BLOCK_GEMV_MAX_ROWS` rows is one pass over the weight: the kernel is for decode steps.
        kind: A GGUF block type of :data:`BLOCK_KINDS`.
        codes: Q4: ``[N, K // 2]`` uint8, the file's code bytes of each block (weight ``j`` in the low
            nibble of byte ``j``, weight ``j + 16`` in its high nibble); Q8_0: ``[N, K]`` uint8, ``q + 128``;
            Q5_0 / Q5_1: ``[N, K * 5 // 8]``, :class:`goodserve.models.q5.Q5Quantized`'s ``q``; K-quants:
            :class:`goodserve.models.kquant.KQuantized`'s ``q``.
        scales: ``[N, K // 32]`` float16; K-quants: ``KQuantized.scales``.
        mins: ``[N, K // 32]`` float16 (Q4_1, Q5_1), or ``None``; K-quants: ``KQuantized.mins``.
        offset: Subtracted from each code: 8 for Q4_0, 16 for Q5_0, 0 for Q4_1 / Q5_1, 128 for Q8_0 as stored
            here; 0 for Q4_K / Q5_K, 32 for Q6_K.
        out_dtype: float32 or bfloat16.

    The weight's operands are checked by :func:`check_blocks` (once, by the caller that holds them).

    Returns:
        ``[rows, N]`` in ``out_dtype``.

    Raises:
        RuntimeError: if the kernel is not available or refuses the call. ValueError: for activations it
        does not take.
    """
    ops = _ops(x)
    rows, k = x.shape
    sub = _K_SUB_DTYPES.get(kind, torch.float16)
    if scales.dtype != torch.float16 or (mins is not None and mins.dtype != sub) \
            or (kind in _K_SUB_DTYPES and mins is None):
        raise ValueError("the weight's scales and minimums must keep their dtypes (see check_blocks)")
    width = block_in_features(kind, scales)
    if x.dtype not in _DTYPES or out_dtype not in _DTYPES or k != width or x.stride(1) != 1:
        raise ValueError(f"x must be [rows, {width}] float32 or bfloat16 with contiguous rows, "
                         f"got {x.dtype} {tuple(x.shape)}")
    return ops.block_gemv(x, BLOCK_KINDS[kind], codes, scales, mins, offset, out_dtype)


def block_gemv_grouped(x: torch.Tensor, kind: str, codes: torch.Tensor, scales: torch.Tensor,
                       mins: Optional[torch.Tensor], offset: int, groups: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`block_gemv` of stacked experts over groups of rows, in one call (a mixture of experts' step).

    Args:
        x: ``[rows, K]`` as :func:`block_gemv`'s.
        kind, offset, out_dtype: As :func:`block_gemv`'s.
        codes, scales, mins: :func:`block_gemv`'s operands of ``E`` experts stacked on a leading axis (each
            expert's checked by :func:`check_blocks`).
        groups: ``[G, 3]`` int64, each ``(expert, first row, rows)``: those rows of ``x`` times that expert's
            weight. Every group's rows are one or more passes of up to :data:`BLOCK_GEMV_MAX_ROWS` rows; all
            groups' passes share one parallel loop.

    Returns:
        ``[rows, N]`` in ``out_dtype``: each group's rows its product; rows in no group are zero.

    Raises:
        RuntimeError: if the kernel is not available or refuses the call (a group's rows outside ``x``, an
        expert outside ``[0, E)``). ValueError: for activations or operands it does not take.
    """
    ops = _ops(x)
    if codes.dim() != 3 or scales.dim() != 3 or (mins is not None and mins.dim() != 3):
        raise ValueError("stacked operands must be [E, N, ...]")
    if groups.dtype != torch.int64 or groups.dim() != 2 or groups.shape[1] != 3 or not groups.is_contiguous():
        raise ValueError("groups must be [G, 3] int64 (expert, first row, rows), contiguous")
    width = block_in_features(kind, scales[0])
    if x.dtype not in _DTYPES or out_dtype not in _DTYPES or x.dim() != 2 or x.shape[1] != width \
            or x.stride(1) != 1:
        raise ValueError(f"x must be [rows, {width}] float32 or bfloat16 with contiguous rows, "
                         f"got {x.dtype} {tuple(x.shape)}")
    return ops.block_gemv_grouped(x, BLOCK_KINDS[kind], codes, scales, mins, offset, groups, out_dtype)
