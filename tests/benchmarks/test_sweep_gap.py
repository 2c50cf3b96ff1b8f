"""The sweep's split of the gap to the model's ceiling: which processes count as the model's, and the two
factors whose product is the ratio the sweep reports."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from benchmarks.sweep import ceiling_gap, pool_children, with_children

# A shell that starts a "main" process, which starts two "pool children" (as Procfile starts Celery).
_TREE = (
    "import subprocess, sys, time\n"
    "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']) for _ in range(2)]\n"
    "time.sleep(60)\n"
)


def test_only_the_pool_children_count_as_the_models_processes():
    shell = subprocess.Popen(["/bin/sh", "-c", f'"{sys.executable}" -c "$0"; :', _TREE])
    try:
        root = psutil.Process(shell.pid)
        deadline = time.monotonic() + 30
        while len(root.children(recursive=True)) < 3:
            assert time.monotonic() < deadline, "the process tree did not start"
            time.sleep(0.05)
        main = root.children()[0]
        found = pool_children(with_children([root]))
        assert sorted(p.pid for p in found) == sorted(p.pid for p in main.children())
        assert main.pid not in {p.pid for p in found} and shell.pid not in {p.pid for p in found}
    finally:
        for proc in psutil.Process(shell.pid).children(recursive=True):
            proc.kill()
        shell.kill()
        shell.wait()


def test_the_two_factors_multiply_to_the_ratio():
    # 98.6 req/s at the peak, the model's processes at 164% of 2 cores, the 2-process ceiling 121.2 texts/s.
    gap = ceiling_gap(98.6, 164, 121.2, 2)
    assert gap.ratio == pytest.approx(98.6 / 121.2)
    assert gap.cpu_share == pytest.approx(0.82)
    assert gap.efficiency == pytest.approx(98.6 / (1.64 * 60.6))
    assert gap.cpu_share * gap.efficiency == pytest.approx(gap.ratio)


def test_no_split_without_the_models_cpu():
    assert ceiling_gap(50.0, 0, 121.2, 2) is None  # the naive server, or a worker not found
    assert ceiling_gap(50.0, 150, 0.0, 2) is None
