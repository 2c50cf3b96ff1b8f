"""A worker's identity comes from the queues it consumes, not from an environment variable (issue 11):
a worker started with `-Q offline` and no WORKER_QUEUE must not announce itself as online, or admission
would count its children as serving online requests that then end in 504."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import redis

from inference.core.keys import DISPATCHERS_KEY, WORKERS_KEY
from tests.conftest import _start, _stop


def wait_for(condition, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def test_a_worker_consuming_the_offline_queue_announces_itself_as_offline(stack, redis_url, tmp_path):
    own_db = redis_url.rsplit("/", 1)[0] + "/12"  # its own heartbeats: the stack's must not mix in
    client = redis.Redis.from_url(own_db, decode_responses=True)
    client.flushdb()
    command = [str(Path(sys.executable).parent / "celery"), "-A", "platform_", "worker", "-Q", "offline", "-c", "1"]
    command += ["--without-gossip", "--without-mingle", "-n", f"role-{os.getpid()}@%h"]
    env = {k: v for k, v in stack.env.items() if k != "WORKER_QUEUE"}
    worker = _start(command, {**env, "REDIS_URL": own_db, "WORKER_MODELS": "identity"}, tmp_path / "worker.log")
    try:
        children = wait_for(lambda: [json.loads(v) for v in client.hvals(WORKERS_KEY)])
        dispatchers = wait_for(lambda: [json.loads(v) for v in client.hvals(DISPATCHERS_KEY)])
    finally:
        _stop(worker)
        client.flushdb()
    assert children, (tmp_path / "worker.log").read_text()[-3000:]
    assert {child["queue"] for child in children} == {"offline"}
    assert {dispatcher["queue"] for dispatcher in dispatchers} == {"offline"}
