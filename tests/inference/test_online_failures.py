"""What callers see when things break: a browser session without CSRF, a worker child killed mid-batch."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until

pytestmark = pytest.mark.integration


def test_a_logged_in_browser_can_predict_with_its_csrf_token_and_not_without(stack):
    session = stack.browser_login()
    url = f"{stack.url}/api/v1/models/router/predict"
    without = session.post(url, json={"inputs": ["I forgot my password"]}, timeout=10)
    assert without.status_code == 403 and "CSRF" in without.json()["detail"]
    with_token = session.post(
        url,
        json={"inputs": ["I forgot my password"]},
        headers={"X-CSRFToken": session.cookies["csrftoken"], "Referer": url},
        timeout=10,
    )
    assert with_token.status_code == 200, with_token.text
    assert with_token.json()["outputs"][0]["label"] == "account"


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process has used so far, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_child_killed_mid_batch_fails_its_callers_fast_instead_of_timing_out(stack):
    (child,) = stack.online_children()
    long_text = " ".join(["the invoice amount differs from the quote we agreed on last month"] * 12)
    result: dict = {}

    def call() -> None:
        started = time.monotonic()
        result["response"] = stack.predict("router", [long_text] * 16)  # 2,048 tokens: seconds on one CPU child
        result["elapsed"] = time.monotonic() - started

    log = stack.log_dir / "online.log"
    loads_before = log.read_text().count("loaded router version")
    cpu_before = cpu_seconds(child["pid"])
    caller = threading.Thread(target=call)
    caller.start()
    # Mid-batch: the request left the queue and the child has computed for a while (an idle child only
    # beats its heartbeat), and the caller is still waiting for the rest of it.
    wait_until(
        lambda: (
            stack.redis.llen("online.router") == 0
            and cpu_seconds(child["pid"]) - cpu_before >= 0.2
            and caller.is_alive()
        ),
        30,
        "the child to be computing the batch",
        interval_s=0.02,
    )
    os.kill(child["pid"], signal.SIGKILL)
    caller.join(timeout=30)
    response = result["response"]
    assert response.status_code == 502, response.text
    assert "worker process died" in response.json()["detail"]
    assert result["elapsed"] < 8, "the caller heard at once, not after its 10 s deadline"
    # The pool replaces the child, which serves again: forked from a main process that preloaded the
    # models (inference/child/worker_process.py, preload), it has them without loading them again.
    wait_until(lambda: any(c["pid"] != child["pid"] for c in stack.online_children()), 120, "a replacement child")
    assert stack.predict("router", ["the app crashes on start"]).status_code == 200
    assert "preloaded" in log.read_text()
    assert log.read_text().count("loaded router version") == loads_before, "the replacement loaded the model again"


def test_an_answer_that_takes_longer_than_five_seconds_still_reaches_its_caller(stack):
    """redis-py's default socket timeout is 5 s: the web tier's wait for a reply (a BLPOP as long as the
    request's deadline) used to end at 5 s in a 503 `broker_unavailable`, with the answer on its way."""
    result: dict = {}
    started = time.monotonic()

    def call() -> None:
        result["response"] = stack.predict("identity", ["slow but in time"], **{"X-Deadline-Ms": "9000"})

    stack.pause_worker()
    try:
        caller = threading.Thread(target=call)
        caller.start()
        # The worker is stopped, so nothing can answer before 6 s have passed: that is the point.
        wait_until(lambda: time.monotonic() - started > 6.0 or not caller.is_alive(), 10, "6 s of waiting")
    finally:
        stack.resume_worker()
    caller.join(timeout=15)
    response = result["response"]
    assert response.status_code == 200, response.text
    assert time.monotonic() - started > 6.0
