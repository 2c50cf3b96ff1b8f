"""Give freed heap memory back to the OS between batches (glibc's malloc_trim).

A child's RSS grew in steps through a 30-minute soak (docs/benchmarks.md, issue 23 item 5): each burst of
larger batches left glibc's arenas holding the freed activations of its biggest pass, and glibc only
returns the top of its main heap by itself. `malloc_trim(0)` releases every free page of every arena.
It walks the heap (milliseconds), so a child calls it after a batch at most every CHILD_MALLOC_TRIM_S,
not after each. Without glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from functools import cache

from django.conf import settings

_last_trim_s = 0.0


@cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def trim_if_due(now_s: float | None = None) -> bool:
    """Release freed heap memory if CHILD_MALLOC_TRIM_S passed since the last time; True when it did."""
    global _last_trim_s
    every_s = settings.CHILD_MALLOC_TRIM_S
    now_s = time.monotonic() if now_s is None else now_s
    trim = _malloc_trim()
    if every_s <= 0 or trim is None or now_s - _last_trim_s < every_s:
        return False
    _last_trim_s = now_s
    trim(0)
    return True
