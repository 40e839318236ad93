"""Process-wide settings for a long-running engine (``goodserve serve``): they trade a little memory for
steady step times. Both were measured on the default model on 2 CPU cores (see BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys

logger = logging.getLogger(__name__)

# mallopt(3) parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest default mmap threshold on 64-bit systems
TRIM_THRESHOLD_BYTES = 1 << 30


def retain_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for the next step instead of handing it back to the kernel.

    A step allocates activations of a few to tens of MB. By default glibc serves blocks above a moving
    threshold with fresh ``mmap``\\ s and trims free heap tops, so the next step page-faults the same memory
    back in: 24,000-48,000 minor faults for a 1,000-token prefill of the default model, which fixed
    ``M_MMAP_THRESHOLD`` (32 MiB) and ``M_TRIM_THRESHOLD`` (1 GiB) bring to none. In a virtual machine a
    page fault can cost far more than on bare metal.

    Returns:
        Whether glibc accepted both settings (``False`` elsewhere, e.g. on macOS or musl).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
            bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False
    if not ok:
        logger.warning("glibc refused the malloc thresholds; steps may page-fault their activations")
    return ok


def freeze_startup_objects() -> int:
    """Move every object alive now (modules, the model, the tokenizer) out of the garbage collector's view.

    After loading, the process holds ~210,000 Python objects that live as long as it does; every full
    collection walked them all, a ~120 ms pause of whichever thread triggered it (often the engine thread
    in the middle of a step). ``gc.freeze`` (Python 3.7+) leaves them out of later collections.

    Returns:
        The number of objects the collector now leaves out (this freeze and any before it).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
