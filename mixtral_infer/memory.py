"""The process's heap: freed pages handed back to the system while loading, kept while running.

glibc's ``malloc`` serves every block larger than its mmap threshold (at most 32 MB by default)
with fresh pages from the system and hands them back when the block is freed. A prompt's
activations are such blocks: one 2048-token chunk of Mistral 7B's feed-forward makes four of
2048 x 14336 float32 values (117 MB each) per layer, every one of them new pages that the kernel
faults in and zeroes on first touch. Measured on a 2-core AMD EPYC VM (torch 2.13.0): ``silu`` of
such a block 38.6 ms into new pages against 7.1 ms into reused ones (about 1 us a 4 KB page; up
to 180 ms a call inside a whole prompt, the VM's pages being slower at times). A 2048-token
prompt of ``mistral-wide`` (Mistral 7B's widths, 4 layers) took 942,000 page faults in float32;
it prefills at 109 tokens/s that way and at 117 with the heap kept (a handful of faults); bfloat16 211
-> 226, mistral-bench float32 753 -> 828 (``bench/bench_heap.py``: one process alternating the
two settings, medians of 3).

``keep_freed_memory`` raises both thresholds so those blocks come from the heap and stay there
for the next chunk, as PyTorch's CUDA caching allocator keeps GPU memory. It also has threads
started afterwards share the main heap: glibc gives each thread an arena of its own, whose heaps
hold no block over 64 MB, and the serving engine runs its steps in a thread (there, without it,
every page of 64 MB blocks and a quarter of 16 MB blocks' pages were faulted in afresh at each
use; mistral-wide bfloat16 prompts in a thread 214-227 tokens/s without, 221-233 with).
``load_model`` calls it for CPU models once their weights are in place. What stays resident is
the largest working set a forward pass has needed (a few hundred MB per 2048-token chunk at 7B
widths); ``release_freed_memory`` hands the free pages back (as ``torch.cuda.empty_cache`` does
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
    about the quantized size again (measured: peak 2.2x the quantized model without this,
    1.1x with it).
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
