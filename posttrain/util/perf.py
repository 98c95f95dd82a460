"""Process-level speed settings for CPU training."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def tune_malloc() -> bool:
    """Keep freed memory in the process instead of returning it to the OS after every step.

    A training step allocates and frees hundreds of MB of temporaries (logits, activations). With
    glibc's defaults each large block is a fresh mmap, so every step pays page faults to zero new
    pages again. This is the runtime form of MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1e11
    MALLOC_TOP_PAD_=1GiB; resident memory then stays at its peak. Skipped when the user set any
    MALLOC_* variable, when POSTTRAIN_MALLOC=default, or off glibc.
    """
    if not sys.platform.startswith("linux") or os.environ.get("POSTTRAIN_MALLOC") == "default":
        return False
    if any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = (mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
          and mallopt(_M_TOP_PAD, 1 << 30) == 1)
    log.debug("glibc malloc tuned for training: %s", ok)
    return ok
