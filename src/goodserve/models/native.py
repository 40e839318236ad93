"""Native CPU kernels: compiled once per machine from ``models/csrc`` and called through ``ctypes``.

PyTorch has no CPU kernel that attends over a paged KV cache in place, so the portable backend gathers
every decode's context into a contiguous copy first (``models/attention.py``); at batch 16 and 384 tokens
of context that copy and the attention after it were a third of a decode step of the default model. The
kernel here reads the blocks where they are.

Building: the first call compiles ``csrc/paged_decode_attention.cpp`` with the system C++ compiler (``c++``,
or ``$CXX``; about a second, no torch headers) into ``$XDG_CACHE_HOME/goodserve/kernels/`` (default
``~/.cache``), keyed by the source's hash, the compiler and the flags, and later processes load the cached
library. Where there is no compiler, or the build fails, :func:`load` returns ``None`` with one warning and
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

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
# -march=native: the library is built on the machine that runs it. -fopenmp: the parallel region binds to
# the libgomp torch has already loaded (same soname), so both share one thread pool.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
#: A split of a request's context holds at least this many tokens (smaller ones cost more to merge).
MIN_SPLIT_TOKENS = 256

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "goodserve" / "kernels"


def _build(compiler: str) -> Path:
    """Compile the kernel (or find it built) and return the library's path.

    Raises:
        subprocess.CalledProcessError, OSError: if compiling fails.
    """
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + compiler.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    path = _cache_dir() / f"paged_decode_attention-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(out)], check=True, capture_output=True, text=True,
                       timeout=300)
        os.replace(out, path)  # atomic: a concurrent build of the same key writes the same bytes
    return path


def load() -> Optional[ctypes.CDLL]:
    """The kernel library, built on first use; ``None`` where it cannot be built or is turned off."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("GOODSERVE_NATIVE_KERNELS", "1") == "0":
            return None
        compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if compiler is None:
            logger.warning("no C++ compiler found: decode attention stays on the portable PyTorch backend")
            return None
        try:
            lib = ctypes.CDLL(str(_build(compiler)))
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or e
            logger.warning("building the native attention kernel failed, using the PyTorch backend: %s", detail)
            return None
        fn = lib.goodserve_paged_decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 9
                       + [ctypes.c_float, ctypes.c_int])
        _lib = lib
        return _lib


_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def supports(q: torch.Tensor) -> bool:
    """Whether the kernel runs attention for queries like ``q`` (CPU, float32 or bfloat16) on this machine."""
    return q.device.type == "cpu" and q.dtype in _DTYPES and load() is not None


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
        RuntimeError: if the kernel is not available (see :func:`supports`) or refuses the call.
        ValueError: on inconsistent shapes, dtypes or layouts.
    """
    lib = load()
    if lib is None or q.device.type != "cpu":
        raise RuntimeError("the native paged attention kernel is not available")
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
    if rc != 0:
        raise RuntimeError(f"the native paged attention kernel refused the call (code {rc})")
    return out
