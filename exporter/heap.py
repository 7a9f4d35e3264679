"""The serving process's heap: the memory a roofline tick frees kept for the next one.

Every roofline tick (``BottleneckMonitor.update``) makes a few hundred numpy arrays the
size of the window, 0.8-3.2 MB each at 100,000 requests, and frees them. glibc's malloc
serves blocks that large with mmap, or from the top of a heap that it gives back to the
system once more than about twice that is free at its top. So each tick's arrays land on
fresh pages: every 4 KiB faulted in and zeroed by the kernel, a third of the tick on the
2-core development host (docs/benchmarks.md). ``keep_freed_pages`` raises both
thresholds (``mallopt``), so that what one tick frees the next reuses. The process's
resident set then stays near its peak between ticks instead of falling back from it; the
peak itself does not move (the same arrays are live at once either way). Over the
memory soft limit the ingest gate still hands free heap back (``Admission._relieve``:
``malloc_trim``), so kept pages cannot hold the process over its limit.

Left alone where it cannot apply or was chosen otherwise: a C library without
``mallopt`` (musl, macOS), or glibc's malloc tuned from the environment
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``).
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("phasewatch")

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (the most its own sliding threshold reaches)
TRIM_THRESHOLD = 128 << 20  # free at the heap's top kept up to this
TUNED = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_pages(environ: os._Environ | dict = os.environ) -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module's
    docstring); True where both took, False where left alone."""
    if any(k in environ for k in TUNED) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        log.debug("heap: malloc tuned from the environment; left as set")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (nor a libc that has it)
        log.debug("heap: no mallopt in this C library; left as it is")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    took = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.debug("heap: %s", f"freed pages kept for reuse (mmap threshold {MMAP_THRESHOLD >> 20}"
              f" MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB)" if took else
              "mallopt refused the thresholds; left as it is")
    return took
