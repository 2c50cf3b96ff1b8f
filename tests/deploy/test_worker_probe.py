"""`manage.py worker_probe`: the workers' liveness and readiness probes, on a real Redis with heartbeats written here.

Each test judges a host name of its own, so the live stack's workers (same Redis, this machine's host name)
never count, and removes what it wrote.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from django.core.management import call_command

from inference.core.keys import DISPATCHERS_KEY, WORKERS_KEY
from tests.conftest import ROOT, free_port

DISPATCHER_S = 1.0  # DISPATCHER_HEARTBEAT_S: a dispatcher counts as stopped after 3 s without a beat
CHILD_S = 2.0  # WORKER_HEARTBEAT_S: a child after 6 s


@pytest.fixture
def host(redis_client: redis.Redis) -> Iterator[str]:
    name = f"worker-router-{uuid.uuid4().hex[:10]}"
    yield name
    for key in (DISPATCHERS_KEY, WORKERS_KEY):
        mine = [f for f in redis_client.hkeys(key) if f.startswith(f"{name}:")]
        if mine:
            redis_client.hdel(key, *mine)


@pytest.fixture
def probe_settings(settings, redis_url):
    settings.REDIS_URL = redis_url
    settings.DISPATCHER_HEARTBEAT_S = DISPATCHER_S
    settings.WORKER_HEARTBEAT_S = CHILD_S
    return settings


def beat_dispatcher(client: redis.Redis, host: str, pid: int, age_s: float) -> None:
    client.hset(DISPATCHERS_KEY, f"{host}:{pid}", json.dumps({"queue": "online", "ts": time.time() - age_s}))


def beat_child(client: redis.Redis, host: str, pid: int, age_s: float, models: list[str], parent: int = 1) -> None:
    entry = {
        "queue": "online",
        "models": models,
        "worker_id": f"{host}:{pid}",
        "dispatcher": f"{host}:{parent}",
        "state": "idle",
        "ts": time.time() - age_s,
    }
    client.hset(WORKERS_KEY, f"{host}:{pid}", json.dumps(entry))


def probe(host: str, which: str, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        call_command("worker_probe", f"--{which}", "--hostname", host)
    out = capsys.readouterr()
    return exited.value.code, (out.out + out.err).strip()


def test_live_when_this_hosts_dispatcher_beat_within_three_intervals(probe_settings, redis_client, host, capsys):
    beat_dispatcher(redis_client, host, 7, age_s=0.5)
    code, line = probe(host, "live", capsys)
    assert code == 0 and line.startswith(f"live: dispatcher {host}:7")


def test_not_live_when_the_dispatcher_stopped_beating(probe_settings, redis_client, host, capsys):
    # The children still beat (they do while their main process is stopped): liveness must not count them.
    beat_dispatcher(redis_client, host, 7, age_s=3.5)
    beat_child(redis_client, host, 8, age_s=0.1, models=["router"], parent=7)
    code, line = probe(host, "live", capsys)
    assert code == 1
    assert line == f"not live: dispatcher {host}:7 last beat 3.5 s ago (limit 3 s)"


def test_not_live_without_a_dispatcher_of_this_host(probe_settings, redis_client, host, capsys):
    beat_dispatcher(redis_client, f"{host}-other", 7, age_s=0.1)  # another pod's fresh beat
    beat_dispatcher(redis_client, f"x{host}", 7, age_s=0.1)
    try:
        code, line = probe(host, "live", capsys)
    finally:
        redis_client.hdel(DISPATCHERS_KEY, f"{host}-other:7", f"x{host}:7")
    assert code == 1 and line.startswith(f"not live: no dispatcher of host {host} ")


def test_the_newest_dispatcher_of_the_host_counts_after_a_container_restart(probe_settings, redis_client, host, capsys):
    beat_dispatcher(redis_client, host, 7, age_s=600)  # the previous container's main process
    beat_dispatcher(redis_client, host, 31, age_s=0.2)
    code, line = probe(host, "live", capsys)
    assert code == 0 and f"{host}:31" in line


def test_ready_when_a_child_of_this_host_beats_with_its_models(probe_settings, redis_client, host, capsys):
    beat_child(redis_client, host, 8, age_s=7, models=["router"])  # a dead child of an earlier start
    beat_child(redis_client, host, 9, age_s=0.5, models=["router"])
    code, line = probe(host, "ready", capsys)
    assert code == 0
    assert line == f"ready: 1 child(ren) of {host} alive with models router"


def test_not_ready_while_models_load_or_when_every_child_is_gone(probe_settings, redis_client, host, capsys):
    beat_dispatcher(redis_client, host, 7, age_s=0.1)  # the main process is up, no child has loaded yet
    code, line = probe(host, "ready", capsys)
    assert code == 1 and line.startswith(f"not ready: no worker child of host {host} ")

    beat_child(redis_client, host, 8, age_s=6.5, models=["router"])
    code, line = probe(host, "ready", capsys)
    assert code == 1
    assert line == f"not ready: no child of {host} alive with models loaded (newest beat 6.5 s ago, limit 6 s)"


def test_a_child_without_models_is_not_ready(probe_settings, redis_client, host, capsys):
    beat_child(redis_client, host, 8, age_s=0.1, models=[])
    code, _ = probe(host, "ready", capsys)
    assert code == 1


def test_both_at_once_pass_only_when_both_would(probe_settings, redis_client, host, capsys):
    beat_dispatcher(redis_client, host, 7, age_s=0.1)
    with pytest.raises(SystemExit) as exited:
        call_command("worker_probe", "--live", "--ready", "--hostname", host)
    assert exited.value.code == 1
    assert capsys.readouterr().err.startswith(f"not ready: no worker child of host {host} ")

    beat_child(redis_client, host, 8, age_s=0.1, models=["router"], parent=7)
    with pytest.raises(SystemExit) as exited:
        call_command("worker_probe", "--live", "--ready", "--hostname", host)
    assert exited.value.code == 0
    line = capsys.readouterr().out
    assert re.fullmatch(
        rf"live: dispatcher {host}:7 \(online\) beat [\d.]+ s ago; ready: 1 child\S* of {host} .*\n", line
    )


def test_as_kubernetes_runs_it_exit_status_and_one_line_and_redis_down(redis_url, redis_client, host):
    """The real command line, as the exec probe runs it: exit status, one line, well inside the probe timeout."""
    beat_dispatcher(redis_client, host, 7, age_s=0.2)
    base = {k: v for k, v in os.environ.items() if k not in ("DISPATCHER_HEARTBEAT_S", "WORKER_HEARTBEAT_S")}

    def run(which: str, url: str) -> tuple[subprocess.CompletedProcess, float]:
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "manage.py", "worker_probe", f"--{which}", "--hostname", host],
            cwd=ROOT,
            env={**base, "REDIS_URL": url},
            capture_output=True,
            text=True,
            timeout=60,
        )
        return result, time.monotonic() - started

    live, live_s = run("live", redis_url)
    assert live.returncode == 0, live.stderr
    assert live.stdout.count("\n") == 1 and live.stdout.startswith("live: ")
    ready, _ = run("ready", redis_url)
    assert ready.returncode == 1 and ready.stderr.startswith("not ready: ")

    # Nothing listens there: liveness is not judged (a Redis outage must not restart every worker),
    # readiness fails; both answer within the 2 s Redis timeout plus start-up.
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    live, down_s = run("live", nowhere)
    assert live.returncode == 0 and live.stdout.startswith("live (not judged): Redis unreachable")
    ready, _ = run("ready", nowhere)
    assert ready.returncode == 1 and ready.stderr.startswith("not ready: Redis unreachable")
    assert live_s < 10 and down_s < 10, (live_s, down_s)
