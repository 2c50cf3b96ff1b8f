"""Intra-op threads for each forward pass, from how many of this host's worker children are in one now.

A child runs with TORCH_THREADS intra-op threads (1 by default) so that children x threads never exceed
the cores under load. At low load that leaves cores idle: at one client a request waits on one child's
one thread while the other core does nothing, and a naive server with torch's default threads answered
faster (issue 23). So before each pass a child counts the children of this host that are in a pass
(itself included) and takes an equal share of the cores, at least TORCH_THREADS and at most
TORCH_MAX_THREADS: alone on 2 cores it runs 2 threads; with a second child busy, 1 each.

Only while the host has been quiet, though: once two children were in a pass at the same moment, every
pass keeps TORCH_THREADS for QUIET_S. A pass started alone cannot shrink when a second one starts a
moment later, and the two then run 3 threads on 2 cores; measured at 2 to 40 closed-loop clients, that
oversubscription cost a third of the throughput (OpenMP threads spin while they wait for each other).
Under load the passes overlap all the time, so they stay at one thread each; at one client they never do.

The count lives in a small shared-memory board (a file under /dev/shm, one per host and user, shared by
every worker process there: online and offline, any number of workers): each child owns a slot, claimed
at start under a file lock, and writes its pid there while it is in a pass. A slot whose owner died is
reclaimed by the next child to start, and is not counted meanwhile. Readers take no lock: one aligned
8-byte store is atomic, and a count a moment stale costs at most one pass run on a wrong share.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

SLOTS = 256
_WORD = 8  # bytes per slot field (int64)
# After two children were last in a pass at once, passes keep their fixed threads this long.
QUIET_S = 1.0


# In the file's name: a board of another layout (an older or newer release on the same host) is another file.
LAYOUT = 2


def _board_path() -> Path:
    shm = Path("/dev/shm")
    folder = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return folder / f"platform-passes-v{LAYOUT}-{os.getuid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _cgroup_cpus() -> float | None:
    """The CPU quota of this process's cgroup in CPUs (a container's or pod's `limits.cpu`), if any."""
    try:  # cgroup v2: "max 100000" or "200000 100000"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def available_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by its cgroup's CPU quota (affinity alone
    names every core of a Kubernetes node whatever the pod's limit)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpus()
    return max(1, min(cores, int(quota))) if quota else cores


class Board:
    """The host's board: `owners` (slot -> owning child's pid), `busy` (slot -> pid while in a pass, else 0),
    then when two children were last in a pass at once (CLOCK_MONOTONIC, ns: one clock for the host)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or _board_path()
        size = (2 * SLOTS + 1) * _WORD
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            found = os.fstat(fd).st_size
            if found not in (0, size):
                raise OSError(f"{self.path} is {found} bytes, not a board of this layout ({size})")
            # Blocks reserved now (zero-filled; a second child doing the same changes nothing): a write to a
            # page of a sparse file on a full tmpfs would kill the child with SIGBUS mid-pass.
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        words = memoryview(self._map).cast("q")
        self._owners, self._busy, self._overlap = words[:SLOTS], words[SLOTS : 2 * SLOTS], words[2 * SLOTS :]
        self.slot: int | None = None

    def claim(self) -> int | None:
        """Take a free slot (or one whose owner died) for this process; None when all are taken."""
        pid = os.getpid()
        with open(self.path, "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            free = []
            for slot in range(SLOTS):
                owner = self._owners[slot]
                # A dead child's slot, or one naming this pid (a dead child's, the pid since reused):
                # cleared, or it would count as a child in a pass for good.
                if owner == pid or owner == 0 or not _alive(owner):
                    self._busy[slot] = 0
                    self._owners[slot] = 0
                    free.append(slot)
            if not free:
                return None
            self.slot = free[0]
            self._owners[self.slot] = pid
            return self.slot

    def release(self) -> None:
        if self.slot is not None and self._owners[self.slot] == os.getpid():
            self._busy[self.slot] = 0
            self._owners[self.slot] = 0
        self.slot = None

    def busy_children(self) -> int:
        """Children in a pass now (a slot marked busy whose owner is alive)."""
        count = 0
        for slot, pid in enumerate(self._busy):
            if pid and self._owners[slot] == pid and _alive(pid):
                count += 1
        return count

    def quiet(self, now_ns: int | None = None) -> bool:
        """Whether no two children were in a pass at once for the last QUIET_S."""
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        return now_ns - self._overlap[0] >= QUIET_S * 1e9

    @contextmanager
    def in_pass(self) -> Iterator[int]:
        """Mark this child in a pass; yields how many children are in one now, itself included (and
        records the moment when that is more than one)."""
        if self.slot is None:
            yield 1
            return
        self._busy[self.slot] = os.getpid()
        try:
            busy = max(1, self.busy_children())
            if busy > 1:
                self._overlap[0] = time.monotonic_ns()
            yield busy
        finally:
            self._busy[self.slot] = 0


def share(busy: int, cores: int, least: int, most: int) -> int:
    """Threads for a pass: an equal share of the cores among the busy children, within [least, most]."""
    return max(least, min(most, cores // max(1, busy)))


class PassThreads:
    """Sets torch's intra-op threads before each pass of a CPU model (see the module's docstring).

    `elastic=False` (an offline child): the child is on the board, so online children see its passes,
    but keeps its fixed threads. Throughput work gains nothing from a lone fast pass, and an offline
    pass that took every core would slow an online pass that starts during it for the rest of it.
    """

    def __init__(self, least: int, most: int, board: Board | None = None, elastic: bool = True) -> None:
        self.cores = available_cores()
        self.least = max(1, least)
        self.most = max(self.least, most or self.cores) if elastic else self.least
        self.board = board
        self.current = self.least
        self.last_share = self.least  # what the last pass ran with (tests and the heartbeat read it)

    @property
    def elastic(self) -> bool:
        return self.board is not None and self.most > self.least

    @contextmanager
    def around_pass(self, on_cpu: bool = True) -> Iterator[None]:
        if self.board is None or not on_cpu:
            yield
            return
        if not self.elastic:
            with self.board.in_pass():  # counted, so elastic children see this pass
                yield
            return
        import torch

        with self.board.in_pass() as busy:
            threads = share(busy, self.cores, self.least, self.most) if self.board.quiet() else self.least
            if threads != self.current:
                torch.set_num_threads(threads)  # cheap (under a microsecond measured): no pool rebuild per pass
                self.current = threads
            self.last_share = threads
            yield


_threads: PassThreads | None = None


def start(least: int, most: int, elastic: bool = True) -> PassThreads:
    """Called once at child start: claim a slot on the host's board unless elastic threads are off
    (TORCH_MAX_THREADS equal to TORCH_THREADS). A child that is not elastic (offline) still takes a
    slot, so that its passes are counted."""
    global _threads
    most = most or available_cores()
    board = None
    if most > least:
        try:
            board = Board()
            if board.claim() is None:
                logger.warning("every slot of %s is taken: this child keeps %d intra-op threads", board.path, least)
                board = None
        except OSError as exc:
            logger.warning("no shared board of passes (%s): this child keeps %d intra-op threads", exc, least)
            board = None
    _threads = PassThreads(least, most, board, elastic)
    return _threads


def stop() -> None:
    if _threads is not None and _threads.board is not None:
        _threads.board.release()


@contextmanager
def around_pass(on_cpu: bool = True) -> Iterator[None]:
    """The pass's threads, when this child started elastic threads (runtime.run wraps each forward in it)."""
    if _threads is None:
        yield
        return
    with _threads.around_pass(on_cpu):
        yield
