"""A child gives freed heap memory back after a batch (inference/child/memory.py): what a soak's RSS shows."""

from __future__ import annotations

import subprocess
import sys

import pytest

from inference.child import memory

# Holes in the heap: blocks freed between blocks still held, which glibc's own trimming (top of the
# heap only) never returns. Run in a fresh process so the heap is this script's alone.
HOLES = r"""
import ctypes, ctypes.util, os, sys
sys.path.insert(0, os.getcwd())
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings.test")
import django; django.setup()
from inference.child import memory
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss_kb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
blocks = [libc.malloc(100_000) for _ in range(600)]
for b in blocks:
    ctypes.memset(b, 1, 100_000)
for b in blocks[::2]:
    libc.free(b)
before = rss_kb()
assert memory.trim_if_due(now_s=1e9)
print(before - rss_kb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_a_trim_returns_freed_heap_holes_to_the_os():
    out = subprocess.run([sys.executable, "-c", HOLES], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    released_kb = int(out.stdout.split()[-1])
    assert released_kb > 20_000  # 300 holes of 100 KB: ~29 MB


def test_trims_are_spaced_and_can_be_turned_off(settings, monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_malloc_trim", lambda: calls.append)
    monkeypatch.setattr(memory, "_last_trim_s", 0.0)
    settings.CHILD_MALLOC_TRIM_S = 10.0
    assert memory.trim_if_due(now_s=100.0)
    assert not memory.trim_if_due(now_s=105.0)
    assert memory.trim_if_due(now_s=111.0)
    settings.CHILD_MALLOC_TRIM_S = 0
    assert not memory.trim_if_due(now_s=500.0)
    assert calls == [0, 0]
