"""The dashboard's data and the sampler's host gauges, on a Redis database of this module's own."""

from __future__ import annotations

import json
import time
from urllib.parse import urlsplit, urlunsplit

import pytest

import platform_.redis
from inference.core.keys import WORKERS_KEY
from inference.core.registry import get_registry
from jobs import monitoring, scheduler
from jobs.keys import offline_queued_rows_field, offline_user_rows_field
from jobs.models import Job, JobStatus
from observability import registry
from observability.dashboard import SERIES_S, SERIES_STEP_S, dashboard_data
from observability.keys import GAUGES_KEY, second_key
from observability.metrics import STATUS_CLASSES, request_fields, write_pipeline
from observability.sampler import host_gauges, sample_once
from tests.jobs.factories import user

DB = 12  # this module's own Redis database (the `client` fixture, tests/observability/conftest.py)


@pytest.fixture(autouse=True)
def _registry_as_found():
    yield
    # The dashboard read the models file through the process-wide registry cache: leave it as found.
    get_registry.cache_clear()


def put(client, second: int, outcomes: dict[str, int], total_ms: float = 40.0) -> None:
    sums: dict[str, float] = {}
    for outcome, count in outcomes.items():
        for _ in range(count):
            for name, value in request_fields("router", outcome, {"total_ms": total_ms}).items():
                sums[name] = sums.get(name, 0) + value
    pipe = client.pipeline(transaction=False)
    write_pipeline(pipe, sums, now=second)  # as the web tier writes: this second's hash and the lifetime one
    pipe.execute()


@pytest.mark.django_db
def test_requests_by_status_now_and_over_a_minute_and_their_series(client):
    now = int(time.time())
    # Windows end at the last complete second; the current one, still filling, is left out.
    put(client, now, {"ok": 1000})
    for s in range(now - 60, now - 6):  # the minute before the last 5 s: 10 answers a second
        put(client, s, {"ok": 10})
    for s in range(now - 5, now):  # the last 5 complete seconds: a load step with refusals and errors
        put(client, s, {"ok": 150, "400": 2, "429": 3, "503_backlog_full": 20, "504": 1, "500": 1})
    client.hset(GAUGES_KEY, mapping={"gauge|host|cores": 2, "gauge|host|cpu_pct": 97.5, "gauge|host|load1": 3.2,
                                     "gauge|host|load5": 2.1, "sampled_at": time.time()})  # fmt: skip
    beat = time.time() - 1.5
    client.hset(WORKERS_KEY, "h:1", json.dumps({"worker_id": "h:1", "queue": "online", "models": ["router"],
                                                "state": "idle", "batches": 3, "started_at": beat - 120, "ts": beat}))  # fmt: skip
    data = dashboard_data(client, now=now + 0.5)

    assert data["requests"]["now"] == {"2xx": 150.0, "4xx": 2.0, "429": 3.0, "503": 20.0, "504": 1.0, "5xx": 1.0}
    minute = data["requests"]["minute"]
    assert minute["2xx"] == pytest.approx((54 * 10 + 5 * 150) / 60, abs=0.01) and minute["503"] == pytest.approx(
        100 / 60, abs=0.01
    )
    # The tile counts every answer of the last 5 s, not the minute's successes (issue 12: 27.5 shown at 152/s).
    assert data["online"]["answered_per_s_5s"] == 177.0 and data["online"]["ok_per_s_5s"] == 150.0
    assert data["online"]["qps"] == pytest.approx(minute["2xx"], abs=0.01)

    series = data["series"]
    assert len(series["t"]) == SERIES_S // SERIES_STEP_S and set(series["status_per_s"]) == set(STATUS_CLASSES)
    assert all(len(v) == len(series["t"]) for v in [series["p95_ms"], *series["status_per_s"].values()])
    assert series["status_per_s"]["503"][-1] > 0 and series["status_per_s"]["2xx"][-1] > 0
    assert series["p95_ms"][-1] is not None and series["p50_ms"][-1] <= series["p95_ms"][-1] <= series["p99_ms"][-1]
    assert series["t"][-1] <= now - 1 < series["t"][-1] + SERIES_STEP_S

    # A busy host, but no finding blames its CPU: the page shows it as busy, not as the jam.
    assert data["host"] == {"cores": 2, "cpu_pct": 97.5, "load1": 3.2, "load5": 2.1, "cpu_findings": []}
    (worker,) = data["workers"]
    assert worker["last_beat_s_ago"] == pytest.approx(1.5, abs=0.5)
    assert worker["started_at"] == pytest.approx(beat - 120, abs=0.01) and worker["up_s"] >= 120
    for kept in ("queues", "online_queues", "sampled_s_ago", "online", "workers", "jobs", "slow", "series", "verdict"):
        assert kept in data


def test_host_gauges_give_cores_load_and_cpu_once_primed():
    first = host_gauges()
    second = host_gauges()
    assert first["gauge|host|cores"] >= 1 and "gauge|host|load1" in first and "gauge|host|load5" in first
    assert 0.0 <= second["gauge|host|cpu_pct"] <= 100.0


def test_the_sampler_writes_every_registered_source_and_the_host(client, monkeypatch):
    monkeypatch.setattr(registry, "_gauges", [lambda c: {"gauge|test|waiting": 4.0}])
    gauges = sample_once(client)
    assert gauges["gauge|test|waiting"] == 4.0 and "gauge|host|cores" in gauges
    latest = client.hgetall(GAUGES_KEY)
    assert latest["gauge|test|waiting"] == "4.0" and "sampled_at" in latest
    assert client.hget(second_key(int(float(latest["sampled_at"]))), "gauge|test|waiting") == "4.0"


def test_apps_registered_their_rules_gauges_and_sections():
    names = [rule.__name__ for rule in registry.rules()]
    assert names[:2] == ["backlog_growing", "workers_missing"]
    assert {"shared_dependency", "offline_stalled", "host_saturated"} <= set(names)
    assert len(registry.gauge_sources()) == 2 and len(registry.dashboard_sections()) == 2


@pytest.mark.django_db
def test_offline_work_per_user_and_priority(client, settings, redis_url, monkeypatch):
    # The standings' offline rate is read through the process's client: pointed at this module's database.
    settings.REDIS_URL = urlunsplit(urlsplit(redis_url)._replace(path=f"/{DB}"))
    monkeypatch.setattr(platform_.redis, "_sync", None)
    monkeypatch.setattr(scheduler, "_cache", None)
    alice, bob, carol = user("alice"), user("bob"), user("carol")

    def job(owner, priority: str, status: str, total: int, done: int = 0) -> Job:
        return Job.objects.create(owner=owner, model="router", status=status, priority=priority, total_rows=total,
                                  done_rows=done, failed_rows=1 if done else 0)  # fmt: skip

    job(alice, "normal", JobStatus.RUNNING, 1000, done=300)  # 699 rows to go
    job(alice, "normal", JobStatus.QUEUED, 200)
    job(alice, "high", JobStatus.QUEUED, 50)
    job(bob, "low", JobStatus.QUEUED, 80)
    job(bob, "low", JobStatus.INGESTING, 0)  # still being read: nothing waits for a worker yet
    job(carol, "normal", JobStatus.SUCCEEDED, 120, done=119)
    now = int(time.time())
    pipe = client.pipeline(transaction=False)
    for second in range(now - 60, now):  # the last complete minute: alice 3 rows/s, carol 1 row/s until her job ended
        write_pipeline(pipe, {offline_user_rows_field("alice", "normal"): 3}, now=second)
        if second < now - 40:
            write_pipeline(pipe, {offline_user_rows_field("carol", "normal"): 3}, now=second)
    pipe.execute()

    data = dashboard_data(client, now=now + 0.5)
    assert data["offline_users"] == [
        {"user": "alice", "priority": "high", "jobs": 1, "rows_queued": 50, "rows_per_s": 0.0},
        {"user": "alice", "priority": "normal", "jobs": 2, "rows_queued": 899, "rows_per_s": 3.0},
        {"user": "carol", "priority": "normal", "jobs": 0, "rows_queued": 0, "rows_per_s": 1.0},
        {"user": "bob", "priority": "low", "jobs": 1, "rows_queued": 80, "rows_per_s": 0.0},
    ]
    # Each running job says its priority and where it stands.
    assert {(j["owner"], j["priority"]) for j in data["jobs"]} == {
        ("alice", "normal"),
        ("alice", "high"),
        ("bob", "low"),
    }
    assert all({"eta_s", "chunks_ahead", "rows_ahead", "waiting_reason"} <= set(j) for j in data["jobs"])

    # The sampled gauge: users with live jobs only; a field left from a user whose jobs ended goes.
    client.hset(GAUGES_KEY, offline_queued_rows_field("dave", "normal"), 12)
    gauges = monitoring.gauges(client)
    assert {k: v for k, v in gauges.items() if k.startswith("gauge|oqrows|")} == {
        offline_queued_rows_field("alice", "high"): 50.0,
        offline_queued_rows_field("alice", "normal"): 899.0,
        offline_queued_rows_field("bob", "low"): 80.0,
    }
    assert client.hget(GAUGES_KEY, offline_queued_rows_field("dave", "normal")) is None
