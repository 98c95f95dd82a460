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


def native_bf16(device: str = "auto") -> bool:
    """Does `device` ('auto': the GPU when there is one, else the CPU) multiply bfloat16 matrices
    at least as fast as float32? A GPU that supports bf16; a CPU whose oneDNN has bf16 kernels
    (AVX-512 and newer). On an AVX2-only CPU torch falls back to a plain loop for bf16 matmuls:
    measured 84x slower than float32 (a 512x576 by 576x1536 product, AMD EPYC, 2 cores)."""
    import torch
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):   # (a torch without oneDNN: no bf16 kernels)
        return False
