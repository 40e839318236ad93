"""Building and loading the native CPU kernels as torch ops (``torch.ops.goodserve.*``).

The kernels (``models/csrc/*.cpp``, plain C++ with a C entry point each, declared in ``csrc/kernels.h``) and
their torch bindings (``csrc/torch_bindings.cpp``: one schema per op, ``TORCH_LIBRARY(goodserve, ...)``) are
compiled with the system C++ compiler (``c++``, or ``$CXX``) into one library under
``$XDG_CACHE_HOME/goodserve/kernels/`` (default ``~/.cache``), keyed by the hash of the sources, the compiler,
the flags, torch's version and the CPU's instruction-set flags (``-march=native``: a cache shared between
machines must not hand one machine another's library), and loaded with ``torch.ops.load_library``.

``scripts/setup.sh`` builds them at install (``python -m goodserve.models.native_build``), so no request
waits for a compiler; a process that finds no build compiles once, with a log line. Where there is no
compiler or the build fails, :func:`load` returns ``False`` with one warning and the engine runs on PyTorch
ops. ``GOODSERVE_NATIVE_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
BINDINGS = CSRC / "torch_bindings.cpp"
KERNELS = sorted(p for p in CSRC.glob("*.cpp") if p != BINDINGS)
HEADERS = sorted(CSRC.glob("*.h"))
# -march=native: the library is built on the machine that runs it. -fopenmp: the parallel regions bind to
# the libgomp torch has already loaded (same soname), so both share one thread pool. -ffp-contract=off: no
# fused multiply-adds the source does not write, so each product is rounded as PyTorch's eager op rounds it.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC"]
KERNEL_FLAGS = ["-std=c++17"]
BINDING_FLAGS = ["-std=c++20", "-O2", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]

_lock = threading.Lock()
_loaded: Optional[bool] = None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "goodserve" / "kernels"


def _cpu_id() -> bytes:
    """The CPU's instruction-set flags."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith(b"flags"):
                    return line
    except OSError:
        pass
    import platform
    return (platform.machine() + platform.processor()).encode()


def _torch_paths() -> tuple[list[str], list[str]]:
    """torch's C++ header and library folders (those ``torch.utils.cpp_extension`` would give, without
    importing it: it imports setuptools)."""
    root = Path(torch.__file__).parent
    return [str(root / "include"), str(root / "include" / "torch" / "csrc" / "api" / "include")], [str(root / "lib")]


def compiler() -> Optional[str]:
    """The C++ compiler the kernels are built with (``$CXX``, ``c++`` or ``g++``), or ``None``."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def library_path(cxx: str) -> Path:
    """Where the library built with ``cxx`` for this machine, these sources and this torch lives."""
    source = b"".join(p.name.encode() + p.read_bytes() for p in KERNELS + [BINDINGS] + HEADERS)
    key = hashlib.sha256(source + cxx.encode() + " ".join(FLAGS + KERNEL_FLAGS + BINDING_FLAGS).encode()
                         + torch.__version__.encode() + _cpu_id()).hexdigest()[:16]
    return _cache_dir() / f"goodserve-kernels-{key}.so"


def build(cxx: str) -> Path:
    """Compile the kernels and their bindings (or find them built) and return the library's path; the
    translation units compile in parallel, one per core.

    Raises:
        subprocess.CalledProcessError, OSError: if compiling fails.
    """
    path = library_path(cxx)
    if path.exists():
        return path
    includes, libdirs = _torch_paths()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        def compile_one(src: Path) -> str:
            obj = str(Path(tmp) / (src.stem + ".o"))
            extra = BINDING_FLAGS + [f"-I{d}" for d in includes] if src == BINDINGS else KERNEL_FLAGS
            subprocess.run([cxx, *FLAGS, *extra, "-c", str(src), "-o", obj], check=True, capture_output=True,
                           text=True, timeout=600)
            return obj

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objects = list(pool.map(compile_one, [BINDINGS] + KERNELS))  # the slow one first
        out = Path(tmp) / path.name
        libs = [f"-L{d}" for d in libdirs] + [f"-Wl,-rpath,{d}" for d in libdirs] + ["-ltorch", "-ltorch_cpu", "-lc10"]
        subprocess.run([cxx, "-shared", "-fopenmp", *objects, "-o", str(out), *libs], check=True, capture_output=True,
                       text=True, timeout=300)
        os.replace(out, path)  # atomic: a concurrent build of the same key writes the same bytes
    return path


def load() -> bool:
    """Whether the kernels are loaded as ``torch.ops.goodserve``: built (at install, or here once) and loaded
    on first call; ``False`` where they cannot be built or are turned off."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        _loaded = False
        if os.environ.get("GOODSERVE_NATIVE_KERNELS", "1") == "0":
            return False
        cxx = compiler()
        if cxx is None:
            logger.warning("no C++ compiler found: the model runs on PyTorch ops only")
            return False
        try:
            path = library_path(cxx)
            if not path.exists():
                logger.info("building goodserve's native kernels (once per machine; scripts/setup.sh builds them "
                            "at install: python -m goodserve.models.native_build)")
            torch.ops.load_library(str(build(cxx)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or e
            logger.warning("building the native kernels failed, the model runs on PyTorch ops only: %s", detail)
            return False
        from goodserve.models import native_fake  # noqa: F401 - registers the ops' fake implementations

        _loaded = True
        _log_capabilities()
        return True


def _log_capabilities() -> None:
    """One line on what this machine's build runs natively and what falls back."""
    ops = torch.ops.goodserve
    missing = []
    if not ops.block_gemv_supported():
        missing.append("GGUF blocks (no AVX-512 VNNI or AVX2: PyTorch's int4 kernel instead)")
    mode = ops.bi_gemm_mode(-1)
    if mode == 0:
        missing.append("batch-invariant GEMM (no AVX512-BF16: GEMM-library tiles instead)")
    elif mode == 1:
        missing.append("AMX (the OS did not grant it, or the CPU has none: AVX512-BF16 instead)")
    if missing:
        logger.info("native kernels loaded; not on this machine: %s", "; ".join(missing))


def main() -> int:
    """``python -m goodserve.models.native_build``: build (or find) the kernels and say where and what."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cxx = compiler()
    if cxx is None:
        logger.warning("no C++ compiler found: goodserve will run on PyTorch ops only")
        return 0
    t0 = time.perf_counter()
    try:
        path = build(cxx)
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("building goodserve's native kernels failed (the engine will run on PyTorch ops): %s",
                       getattr(e, "stderr", "") or e)
        return 0
    logger.info("goodserve native kernels: %s (%.1f s)", path, time.perf_counter() - t0)
    load()
    return 0


if __name__ == "__main__":
    sys.exit(main())
