"""Elastic intra-op threads (inference/child/cores.py): a lone pass takes the idle cores, busy children share them."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from inference.child.cores import Board, PassThreads, share


def test_the_cores_are_shared_among_the_children_in_a_pass():
    assert share(busy=1, cores=2, least=1, most=2) == 2  # alone: both cores
    assert share(busy=2, cores=2, least=1, most=2) == 1
    assert share(busy=5, cores=2, least=1, most=2) == 1  # never below TORCH_THREADS
    assert share(busy=1, cores=16, least=1, most=4) == 4  # never above TORCH_MAX_THREADS
    assert share(busy=3, cores=16, least=2, most=8) == 5


def _hold_a_pass(path, entered, leave) -> None:
    board = Board(path)
    board.claim()
    with board.in_pass():
        entered.set()
        leave.wait(30)


def test_a_child_in_a_pass_in_another_process_is_counted_and_its_end_is_seen(tmp_path):
    path = tmp_path / "board"
    mine = Board(path)
    assert mine.claim() is not None
    context = multiprocessing.get_context("fork")
    entered, leave = context.Event(), context.Event()
    other = context.Process(target=_hold_a_pass, args=(path, entered, leave))
    other.start()
    try:
        assert entered.wait(30)
        with mine.in_pass() as busy:
            assert busy == 2
        leave.set()
        other.join(30)
        with mine.in_pass() as busy:
            assert busy == 1
    finally:
        leave.set()
        other.join(30)


def _die_in_a_pass(path) -> None:
    board = Board(path)
    board.claim()
    with board.in_pass():
        os._exit(0)  # killed mid-pass: its slot still says busy


def test_a_child_that_died_in_a_pass_is_not_counted_and_its_slot_is_reused(tmp_path):
    path = tmp_path / "board"
    context = multiprocessing.get_context("fork")
    dead = context.Process(target=_die_in_a_pass, args=(path,))
    dead.start()
    dead.join(30)
    board = Board(path)
    assert board.busy_children() == 0
    assert board.claim() == 0, "the dead child's slot is taken again"
    with board.in_pass() as busy:
        assert busy == 1


def test_a_lone_pass_runs_on_the_idle_cores_and_fixed_threads_never_change(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    board = Board(tmp_path / "board")
    board.claim()
    threads = PassThreads(least=1, most=2, board=board)
    threads.cores = 2
    try:
        with threads.around_pass():
            assert torch.get_num_threads() == 2
        fixed = PassThreads(least=1, most=1, board=board)
        assert not fixed.elastic
        torch.set_num_threads(1)
        with fixed.around_pass():
            assert torch.get_num_threads() == 1
        with threads.around_pass(on_cpu=False):  # a GPU pass: the CPU threads are not its business
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_after_two_passes_overlapped_a_lone_pass_keeps_its_fixed_threads_for_a_while(tmp_path, monkeypatch):
    """Under load passes overlap all the time: a pass started alone must not take every core just before
    another child starts one (3 threads on 2 cores cost a third of the throughput, measured)."""
    torch = pytest.importorskip("torch")
    from inference.child import cores
    from tests.conftest import wait_until

    monkeypatch.setattr(cores, "QUIET_S", 0.3)
    before = torch.get_num_threads()
    path = tmp_path / "board"
    board = Board(path)
    board.claim()
    threads = PassThreads(least=1, most=2, board=board)
    threads.cores = 2
    context = multiprocessing.get_context("fork")
    entered, leave = context.Event(), context.Event()
    other = context.Process(target=_hold_a_pass, args=(path, entered, leave))
    other.start()
    try:
        assert entered.wait(30)
        with threads.around_pass():
            assert threads.last_share == 1  # two in a pass: one thread each
        leave.set()
        other.join(30)
        with threads.around_pass():
            assert threads.last_share == 1, "alone now, but passes overlapped a moment ago"
        wait_until(board.quiet, 5, "the host to be quiet for QUIET_S", interval_s=0.05)
        with threads.around_pass():
            assert threads.last_share == 2
    finally:
        leave.set()
        other.join(30)
        torch.set_num_threads(before)


def test_an_offline_child_is_counted_on_the_board_but_keeps_its_threads(tmp_path):
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    path = tmp_path / "board"
    offline_board, online_board = Board(path), Board(path)
    offline_board.claim()
    offline = PassThreads(least=1, most=2, board=offline_board, elastic=False)
    offline.cores = 2
    torch.set_num_threads(1)
    try:
        with offline.around_pass():
            assert torch.get_num_threads() == 1, "offline work gains nothing from a lone fast pass"
            assert online_board.busy_children() == 1, "but an online child sees it in a pass"
    finally:
        torch.set_num_threads(before)


def test_the_cores_of_a_container_are_its_cpu_quota_not_the_nodes(monkeypatch):
    from inference.child import cores

    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: set(range(32)))
    monkeypatch.setattr(cores, "_cgroup_cpus", lambda: 2.0)
    assert cores.available_cores() == 2
    monkeypatch.setattr(cores, "_cgroup_cpus", lambda: 0.5)
    assert cores.available_cores() == 1
    monkeypatch.setattr(cores, "_cgroup_cpus", lambda: None)
    assert cores.available_cores() == 32
