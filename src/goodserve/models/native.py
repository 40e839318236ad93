"""Native CPU kernels: compiled once per machine from ``models/csrc`` and called through ``ctypes``.

- :func:`paged_decode_attention`: PyTorch has no CPU kernel that attends over a paged KV cache in place, so
  the portable backend gathers every decode's context into a contiguous copy first (``models/attention.py``);
  at batch 16 and 384 tokens of context that copy and the attention after it were a third of a decode step
  of the default model. The kernel reads the blocks where they are.
- :func:`rms_norm` (with the residual add before it) and :func:`rope`: at decode sizes each is several eager
  ops of a few microseconds of dispatch, more than their arithmetic, ~180 calls per step of the default
  model; here each is one call, rounded as the ops it replaces.
- :func:`argmax`: greedy sampling. PyTorch's CPU argmax over a batch's logits cost ~10x a max over the same
  rows (4.3-7.8 ms at batch 64, 49,152 tokens).

Building: the first call compiles every ``csrc/*.cpp`` with the system C++ compiler (``c++``, or ``$CXX``;
a few seconds, no torch headers) into one library under ``$XDG_CACHE_HOME/goodserve/kernels/`` (default
``~/.cache``), keyed by the hash of the sources and headers, the compiler, the flags and the CPU's
instruction-set flags, and later processes load the cached library. Where there is no compiler, or the build fails, :func:`load` returns ``None`` with one warning and
the engine stays on the portable backend. ``GOODSERVE_NATIVE_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
# -march=native: the library is built on the machine that runs it. -fopenmp: the parallel region binds to
# the libgomp torch has already loaded (same soname), so both share one thread pool. -ffp-contract=off: no
# fused multiply-adds the source does not write, so each product is rounded as PyTorch's eager op rounds it.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
#: A split of a request's context holds at least this many tokens (smaller ones cost more to merge).
MIN_SPLIT_TOKENS = 256

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False
#: Whether the model's norms and RoPE run on the native kernels where they can (a switch for A/B benchmarks).
use_decoder_ops = True


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "goodserve" / "kernels"


def _cpu_id() -> bytes:
    """The CPU's instruction-set flags (``-march=native`` builds for them; a cache shared between machines
    must not hand one machine another's library)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith(b"flags"):
                    return line
    except OSError:
        pass
    import platform
    return (platform.machine() + platform.processor()).encode()


def _build(compiler: str) -> Path:
    """Compile the kernels (or find them built) and return the library's path.

    Raises:
        subprocess.CalledProcessError, OSError: if compiling fails.
    """
    source = b"".join(p.name.encode() + p.read_bytes() for p in SOURCES + HEADERS)
    key = hashlib.sha256(source + compiler.encode() + " ".join(FLAGS).encode() + _cpu_id()).hexdigest()[:16]
    path = _cache_dir() / f"goodserve-kernels-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(out)], check=True, capture_output=True,
                       text=True, timeout=300)
        os.replace(out, path)  # atomic: a concurrent build of the same key writes the same bytes
    return path


def load() -> Optional[ctypes.CDLL]:
    """The kernel library, built on first use; ``None`` where it cannot be built or is turned off."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("GOODSERVE_NATIVE_KERNELS", "1") == "0":
            return None
        compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if compiler is None:
            logger.warning("no C++ compiler found: the model runs on PyTorch ops only")
            return None
        try:
            lib = ctypes.CDLL(str(_build(compiler)))
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or e
            logger.warning("building the native kernels failed, the model runs on PyTorch ops only: %s", detail)
            return None
        fn = lib.goodserve_paged_decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 9
                       + [ctypes.c_float, ctypes.c_int])
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.goodserve_rms_norm.restype = ctypes.c_int
        lib.goodserve_rms_norm.argtypes = [ctypes.c_int, vp, i64, vp, i64, vp, vp, vp, i64, i64, ctypes.c_float,
                                           ctypes.c_int]
        lib.goodserve_rope.restype = ctypes.c_int
        lib.goodserve_rope.argtypes = [ctypes.c_int, vp, i64, vp, i64, vp, vp, i64, i64, i64, ctypes.c_int]
        lib.goodserve_argmax.restype = ctypes.c_int
        lib.goodserve_argmax.argtypes = [ctypes.c_int, vp, i64, i64, i64, vp, ctypes.c_int]
        _lib = lib
        return _lib


_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _library(x: torch.Tensor) -> ctypes.CDLL:
    """The loaded library for a call on ``x``.

    Raises:
        RuntimeError: if the kernels are not built or ``x`` is not on the CPU.
    """
    lib = load()
    if lib is None or x.device.type != "cpu":
        raise RuntimeError("the native kernels are not available (they run on the CPU where they build)")
    return lib


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise RuntimeError(f"the native {name} kernel refused the call (code {rc})")


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels take tensors like ``x``: on the CPU, float32 or bfloat16, the library built."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and load() is not None


def usable(x: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` and :func:`rope` run for tensors like ``x`` (:func:`supports`, and
    :data:`use_decoder_ops` on)."""
    return use_decoder_ops and supports(x)


def num_splits(num_seqs: int, max_len: int, num_threads: int) -> int:
    """Splits of each request's context: enough work items (a request's split, all its KV heads) for every
    thread, 4 per thread, each split at least :data:`MIN_SPLIT_TOKENS` long."""
    if num_seqs >= 4 * num_threads:
        return 1
    return max(1, min(math.ceil(max_len / MIN_SPLIT_TOKENS), math.ceil(4 * num_threads / num_seqs)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                           scale: Optional[float] = None) -> torch.Tensor:
    """Attention of one query token per request over its paged context, read in place.

    Args:
        q: ``[n, num_heads, head_dim]``; rows may be strided (e.g. a slice of a fused QKV output), each
            row's heads contiguous.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, same dtype as ``q``.
        v_cache: same shape as ``k_cache``.
        block_tables: ``[n, max_blocks]`` int32; row ``i`` covers request ``i``'s ``seq_lens[i]`` tokens.
        seq_lens: ``[n]`` int32 context length of each request, its new token included (≥ 1).
        max_len: ``max(seq_lens)`` (known to the caller without a read of the tensor).
        scale: Softmax scale; default ``1 / sqrt(head_dim)``.

    Returns:
        ``[n, num_heads, head_dim]``, ``q``'s dtype.

    Raises:
        RuntimeError: if the kernels are not available (see :func:`load`) or the kernel refuses the call.
        ValueError: on inconsistent shapes, dtypes or layouts.
    """
    lib = _library(q)
    n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q and the caches must share a dtype among {list(_DTYPES)}")
    if cache_head_dim != head_dim or num_heads % num_kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError("q, k_cache and v_cache shapes disagree")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or q.stride(2) != 1 or q.stride(1) != head_dim:
        raise ValueError("the caches must be contiguous and each query row's heads contiguous")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.shape[0] != n \
            or seq_lens.shape != (n,) or not block_tables.is_contiguous():
        raise ValueError("block_tables must be [n, max_blocks] int32 and seq_lens [n] int32, contiguous")
    out = torch.empty((n, num_heads, head_dim), dtype=q.dtype)
    if n == 0:
        return out
    threads = torch.get_num_threads()
    splits = num_splits(n, max_len, threads)
    split_tokens = -(-max_len // splits)
    rc = lib.goodserve_paged_decode_attention(
        _DTYPES[q.dtype], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), n, num_heads, num_kv_heads, head_dim, block_size,
        block_tables.shape[1], q.stride(0), split_tokens, splits,
        scale if scale is not None else 1.0 / math.sqrt(head_dim), threads)
    _check(rc, "paged attention")
    return out


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
    lib = _library(x)
    _rows(x, "x")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or weight.shape != (x.shape[1],) \
            or not weight.is_contiguous():
        raise ValueError(f"weight must be [{x.shape[1]}] contiguous and share x's dtype among {list(_DTYPES)}")
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=x.dtype)
    h = x
    if residual is not None:
        _rows(residual, "residual")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must have x's shape and dtype")
        h = torch.empty((rows, cols), dtype=x.dtype)
    rc = lib.goodserve_rms_norm(_DTYPES[x.dtype], x.data_ptr(), x.stride(0),
                                None if residual is None else residual.data_ptr(),
                                0 if residual is None else residual.stride(0),
                                None if residual is None else h.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                rows, cols, eps, torch.get_num_threads())
    _check(rc, "rms_norm")
    return out, h


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
    lib = _library(x)
    rows, heads, head_dim = x.shape
    if x.dtype not in _DTYPES or table.dtype != x.dtype or not table.is_contiguous() or table.dim() != 3 \
            or table.shape[0] != 2 or table.shape[2] != head_dim:
        raise ValueError("table must be [2, max_positions, head_dim] contiguous in x's dtype")
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError("each row's heads of x must be contiguous")
    if positions.dtype != torch.int64 or positions.shape != (rows,) or not positions.is_contiguous():
        raise ValueError("positions must be [rows] int64, contiguous")
    out = torch.empty((rows, heads, head_dim), dtype=x.dtype)
    rc = lib.goodserve_rope(_DTYPES[x.dtype], x.data_ptr(), x.stride(0), table.data_ptr(), table.stride(0),
                            positions.data_ptr(), out.data_ptr(), rows, heads, head_dim, torch.get_num_threads())
    _check(rc, "rope")
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``: the first index of each row's maximum, or of its first NaN.

    Args:
        x: ``[rows, cols]`` float32 or bfloat16, ``cols >= 1``, rows contiguous (a row stride is allowed).

    Returns:
        ``[rows]`` int64.

    Raises:
        RuntimeError: if the kernels are not available. ValueError: on a shape, layout or dtype it does not take.
    """
    lib = _library(x)
    _rows(x, "x")
    if x.dtype not in _DTYPES or x.shape[1] < 1:
        raise ValueError(f"x must be float32 or bfloat16 with at least one column, got {x.dtype} {tuple(x.shape)}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _check(lib.goodserve_argmax(_DTYPES[x.dtype], x.data_ptr(), x.stride(0), x.shape[0], x.shape[1],
                                out.data_ptr(), torch.get_num_threads()), "argmax")
    return out
