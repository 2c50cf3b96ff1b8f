"""CPU priority between the platform's processes on a shared host."""

from __future__ import annotations

import os


def lower_cpu_priority(nice: int) -> None:
    """Make this process yield the CPU to others: nice for the process, and for its autogroup.

    With the kernel's autogroup scheduling (the default on desktop and many server kernels), CPU is
    shared fairly between sessions first, and a process's nice value only counts inside its own
    session: `nice -n 10 celery ...` started in its own session (as honcho and containers do) still
    gets half the CPU against the online worker (measured with the offline worker). The autogroup's own nice value is what counts
    across sessions, so it is raised too.
    """
    current = os.nice(0)
    if nice > current:
        os.nice(nice - current)
    try:
        with open("/proc/self/autogroup", "w") as handle:
            handle.write(str(nice))
    except OSError:
        pass  # no autogroup scheduling here: the process nice value is enough
