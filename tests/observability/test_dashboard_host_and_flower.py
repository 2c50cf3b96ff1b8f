"""What data.json tells the dashboard about the host's CPU and about the Celery workers, on a Redis database
of this module's own (issue 24: red CPU tiles beside "no jam"; Flower's 2 workers against the page's 3)."""

from __future__ import annotations

import json
import time

import pytest

from inference.core.keys import DISPATCHERS_KEY, WORKERS_KEY
from inference.core.registry import get_registry
from inference.web import diagnosis as online
from observability.dashboard import cpu_findings, dashboard_data
from observability.diagnosis import Snapshot, diagnose
from observability.keys import GAUGES_KEY

DB = 9  # this module's own Redis database (the `client` fixture, tests/observability/conftest.py)


@pytest.fixture(autouse=True)
def _registry_as_found():
    yield
    get_registry.cache_clear()  # the dashboard read the models file through the process-wide cache


def figures(**changes) -> Snapshot:
    """A minute that answers fast on a host whose CPU is busy (as tests/observability/test_rules.py's healthy)."""
    base = dict(
        window_s=60, requests_per_s=40, ok_per_s=40, p50_s=0.05, p99_s=0.09, inference_p50_s=0.02,
        queue_wait_p50_s=0.003, batch_wait_p50_s=0.004, mean_batch_size=2.0, mean_fill=0.1,
        online_backlog=[1.0] * 60, online_in_flight=3, online_workers_now=2, online_workers_min=2,
        online_workers_series=[2.0] * 60, ok_series=[40.0] * 60, busy_fraction=0.7, worker_cpu_pct=70,
        host_cpu_pct=99.0, host_load1=4.0, host_cores=2,
    )  # fmt: skip
    base.update(changes)
    return Snapshot(**base)


def blamed(snapshot: Snapshot) -> list[str]:
    return cpu_findings(diagnose(snapshot), snapshot)


def test_a_busy_cpu_that_answers_fast_is_blamed_for_nothing():
    busy = figures()
    assert diagnose(busy) == [] and blamed(busy) == []


def test_a_starved_host_is_what_the_cpu_tiles_blame():
    starved = figures(p99_s=1.2, busy_fraction=0.3, host_load1=9.5)
    assert blamed(starved) == ["host CPU saturated (every process waits for a core)"]


def test_saturated_model_compute_blames_the_cpu_only_where_there_is_no_gpu():
    computing = dict(p99_s=1.5, busy_fraction=0.97, host_cpu_pct=60.0, host_load1=1.2)
    on_cpu = figures(**computing)
    assert "compute_saturated" in [f.rule for f in diagnose(on_cpu)]
    assert blamed(on_cpu) == [online.compute_saturated(on_cpu).symptom]
    on_gpu = figures(**computing, gpu_util_pct=95.0)
    assert "compute_saturated" in [f.rule for f in diagnose(on_gpu)] and blamed(on_gpu) == []


@pytest.mark.django_db
def test_celery_workers_are_counted_as_flower_counts_them(client, settings):
    """Flower's "Online workers" counts Celery workers (their main processes); the page counts their children too."""
    now = time.time()
    online_main, offline_main, gone_main = "h:100", "h:200", "h:300"
    client.hset(DISPATCHERS_KEY, mapping={
        online_main: json.dumps({"queue": "online", "ts": now - 0.5}),
        offline_main: json.dumps({"queue": "offline", "ts": now - 0.5}),
        # Stopped long ago: no beat for ten intervals. Flower shows such a worker offline, and so not in its count.
        gone_main: json.dumps({"queue": "online", "ts": now - 10 * settings.DISPATCHER_HEARTBEAT_S}),
    })  # fmt: skip
    children = [("h:101", "online", online_main), ("h:102", "online", online_main), ("h:201", "offline", offline_main)]
    for child, queue, main in children:
        client.hset(WORKERS_KEY, child, json.dumps({"worker_id": child, "queue": queue, "models": ["router"],
                                                    "dispatcher": main, "state": "idle", "batches": 0,
                                                    "started_at": now - 60, "ts": now - 0.5}))  # fmt: skip
    client.hset(GAUGES_KEY, mapping={"gauge|host|cores": 2, "gauge|host|cpu_pct": 98.0, "gauge|host|load1": 3.5})

    data = dashboard_data(client, now=now)

    assert len(data["workers"]) == 3
    assert data["celery_workers"] == [
        {"id": online_main, "queue": "online", "processes": 2},
        {"id": offline_main, "queue": "offline", "processes": 1},
    ]
    # Busy, and nothing in the last minute blames the CPU: the page shows it as busy, not as the jam.
    assert data["host"]["cpu_findings"] == [] and data["verdict"]["text"].startswith("no jam")
