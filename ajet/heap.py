"""Hand the C heap's free memory back to the operating system (glibc's `malloc_trim`).

Why: the debug backbone samples in the engine's worker thread and trains in the trainer's thread. glibc gives each
thread its own malloc arena, and memory freed in one arena is kept for that arena's later allocations: after a
held-out evaluation of 160 problems the engine's arena held several GB of freed KV-cache blocks (every decode step
reallocates each layer's cache), which the update, allocating in another arena, could not reuse, so its peak came on
top of them (the main job peaked at 11.2 GB resident without this trim, 8.2 GB with it, where one update alone
peaks at 5.9 GB; docs/benchmarks.md).
`malloc_trim(0)` returns the free pages of every arena (glibc >= 2.8 also releases whole free pages inside a heap),
so the update starts from what is really in use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc_malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_free_memory() -> bool:
    """Return the free memory of every malloc arena to the operating system (`malloc_trim(0)`). Objects in use are
    untouched; it costs a walk over the heaps (milliseconds to tens of milliseconds for GBs of them).

    Returns:
        True when memory was released, False when there was none to release or the C library has no
        `malloc_trim` (then it does nothing).
    """
    trim = _libc_malloc_trim()
    return bool(trim(0)) if trim is not None else False
