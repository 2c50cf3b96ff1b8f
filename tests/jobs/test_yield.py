"""Offline passes start in the gaps of online traffic, and a job still moves when there are none."""

from __future__ import annotations

import time

from jobs.runner import yield_to_online


def test_waits_until_online_work_is_done():
    answers = iter([3, 2, 1, 0])
    waited = yield_to_online(lambda: next(answers), max_wait_s=5, poll_s=0.01)
    assert 0.02 <= waited < 1


def test_never_waits_past_the_cap_when_online_never_pauses():
    started = time.monotonic()
    waited = yield_to_online(lambda: 1, max_wait_s=0.1, poll_s=0.01)
    assert 0.1 <= waited < 0.5 and time.monotonic() - started < 0.5


def test_no_online_work_no_wait():
    assert yield_to_online(lambda: 0, max_wait_s=5) < 0.01
