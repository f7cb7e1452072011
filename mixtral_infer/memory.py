"""The process's heap: freed pages handed back to the system while loading, kept while running.

glibc's ``malloc`` serves every block larger than its mmap threshold (at most 32 MB by default)
with fresh pages from the system and hands them back when the block is freed. A prompt's
activations are such blocks: one 2048-token chunk of Mistral 7B's feed-forward makes four of
2048 x 14336 float32 values (117 MB each) per layer, every one of them new pages that the kernel
faults in and zeroes on first touch, at a cost that can exceed the arithmetic done in them
(docs/performance.md, "The heap").

``keep_freed_memory`` raises both thresholds so those blocks come from the heap and stay there
for the next chunk, as PyTorch's CUDA caching allocator keeps GPU memory. It also has threads
started afterwards share the main heap: glibc gives each thread an arena of its own, whose heaps
hold no block over 64 MB, and the serving engine runs its steps in a thread, where large
blocks would otherwise get fresh pages at each use. It changes the whole process, so the
library never calls it: the command line and the server do, once a CPU model is loaded. What stays resident is the largest working set a forward pass has
needed; ``release_freed_memory`` hands the free pages back (as ``torch.cuda.empty_cache`` does
on a GPU), and quantizing calls it while loading. Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1  # free memory at the heap's top is handed back beyond this many bytes
M_MMAP_THRESHOLD = -3  # blocks of at least this many bytes get pages of their own (mmap)
M_ARENA_MAX = -8  # how many arenas (heaps) threads may use; 1: all share the main heap
KEPT_BLOCK_BYTES = 1 << 30  # blocks below 1 GB come from the heap once kept
OLD_GLIBC_MAX_BYTES = 32 << 20  # where a glibc refuses more (half its 64 MB arena heaps; 2.36 takes 1 GB)


def keep_freed_memory() -> None:
    """Serve blocks below ``KEPT_BLOCK_BYTES`` from the main heap, in every thread started from
    now on, and keep freed ones for reuse. Process-wide; calling it again is harmless."""
    if _LIBC is None:
        return
    _LIBC.mallopt(M_ARENA_MAX, 1)
    if not _LIBC.mallopt(M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES):
        _LIBC.mallopt(M_MMAP_THRESHOLD, OLD_GLIBC_MAX_BYTES)
    _LIBC.mallopt(M_TRIM_THRESHOLD, KEPT_BLOCK_BYTES)


def release_freed_memory() -> None:
    """Give the pages of freed blocks back to the system (glibc's ``malloc_trim``).

    Quantizing leaves the float tensor and its working copies freed between the integers
    the model keeps; glibc keeps such holes resident, and over a model they add up to
    about the quantized size again (docs/performance.md, "The heap").
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


_LIBC = _glibc()
