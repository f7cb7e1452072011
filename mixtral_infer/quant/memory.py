"""Handing the pages of freed working copies back to the system while quantizing or packing weights."""

from __future__ import annotations

import ctypes
import sys


def release_freed_memory() -> None:
    """Give the pages of freed working copies back to the system (glibc's ``malloc_trim``).

    Quantizing leaves the float tensor and its working copies freed between the integers
    the model keeps; glibc keeps such holes resident, and over a model they add up to
    about the quantized size again (measured: peak 2.2x the quantized model without this,
    1.1x with it). Elsewhere than glibc this does nothing.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()
