"""Metrics arithmetic and the Prometheus text, on figures made for the test."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobs.keys import offline_queued_rows_field, offline_user_rows_field
from observability import metrics
from observability.keys import TOTAL_KEY, second_key
from observability.prometheus import render


def test_request_fields_put_each_stage_in_its_bucket():
    fields = metrics.request_fields("router", "ok", {"total_ms": 30.0, "inference_ms": 12.0})
    assert fields["req|router|ok"] == 1 and fields["status|2xx"] == 1
    assert fields[f"lat|router|total|{metrics.latency_bucket(0.030)}"] == 1
    assert metrics.LATENCY_BUCKETS_S[metrics.latency_bucket(0.030)] == 0.035
    assert fields["latsum|router|inference"] == pytest.approx(0.012)
    assert not any("|queue_wait|" in k for k in fields)


def test_batch_fields_count_passes_sizes_and_fill():
    fields = metrics.batch_fields("router", [4, 4, 1], max_batch_size=8, inference_s=0.05)
    assert fields["passes|router"] == 3 and fields["pass_texts|router"] == 9
    assert fields["fill|router"] == pytest.approx(0.5 + 0.5 + 0.125)
    assert fields[f"bsize|router|{metrics.size_bucket(4)}"] == 2
    # One dispatch of 9 texts, run as those three passes.
    assert fields["dispatches|router"] == 1 and fields["dispatch_texts|router"] == 9
    assert "dispatches|router" not in metrics.batch_fields("router", [], max_batch_size=8, inference_s=0.0)


def test_percentiles_interpolate_inside_buckets():
    counts = [0.0] * (len(metrics.LATENCY_BUCKETS_S) + 1)
    counts[metrics.latency_bucket(0.045)] = 100  # all in (0.035, 0.05]
    assert 0.035 < metrics.histogram_percentile(counts, 50) <= 0.05
    assert metrics.histogram_percentile([0.0] * len(counts), 50) is None


def test_window_sums_by_model_and_outcome():
    w = metrics.Window(
        seconds=60, counters={"req|a|ok": 10, "req|a|503_deadline": 2, "req|b|ok": 5, "passes|a": 4, "pass_texts|a": 10}
    )
    assert w.requests() == 17 and w.requests("a") == 12 and w.requests(outcome="503") == 2
    assert w.mean_batch_size("a") == 2.5 and w.mean_batch_size("b") is None


def test_prometheus_text_has_counters_cumulative_histograms_and_gauges():
    totals = {
        "req|router|ok": 7,
        "req|router|503_backlog_full": 2,
        f"lat|router|total|{metrics.latency_bucket(0.02)}": 5,
        f"lat|router|total|{metrics.latency_bucket(0.3)}": 2,
        "latsum|router|total": 0.7,
        f"bsize|router|{metrics.size_bucket(3)}": 4,
        "pass_texts|router": 12,
        "orows|router": 100,
        "passes|router": 4,
        "fill|router": 1.5,
    }
    gauges = {
        "gauge|online|waiting": 3,
        "gauge|workers|online": 2,
        "gauge|rss_mb|online": 100,
        "gauge|host|cpu_pct": 97,
    }
    text = render(totals, gauges)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("inference_requests_total", model="router", outcome="ok", status="2xx") == 7
    assert value("inference_requests_total", model="router", outcome="503_backlog_full", status="503") == 2
    assert value("inference_admission_refusals_total", model="router", reason="backlog_full") == 2
    assert value("inference_stage_latency_seconds_bucket", model="router", stage="total", le="0.02") == 5
    assert value("inference_stage_latency_seconds_bucket", model="router", stage="total", le="+Inf") == 7
    assert value("inference_stage_latency_seconds_count", model="router", stage="total") == 7
    assert value("inference_stage_latency_seconds_sum", model="router", stage="total") == pytest.approx(0.7)
    assert value("inference_batch_size_bucket", model="router", le="4") == 4
    assert value("inference_batch_fill_ratio_sum", model="router") == pytest.approx(1.5)
    assert value("inference_batch_fill_ratio_count", model="router") == 4
    assert value("offline_rows_total", model="router") == 100
    assert value("platform_queue_depth", queue="online", state="waiting") == 3
    assert value("platform_worker_processes", queue="online") == 2
    assert value("platform_host_cpu_percent") == 97
    assert "# TYPE inference_stage_latency_seconds histogram" in text
    # The names the KEDA trigger and the docs query, exactly as written there.
    assert 'platform_queue_depth{queue="online",state="waiting"} 3.0' in text


def test_offline_work_per_user_and_priority_on_metrics():
    totals = {
        offline_user_rows_field("alice", "high"): 40,
        offline_user_rows_field("bob", "normal"): 7,
        "orows|router": 47,
    }
    # Only users with live jobs have a queued-rows gauge (the sampler drops the others' fields).
    gauges = {offline_queued_rows_field("alice", "high"): 60, "gauge|offline|waiting": 2}
    text = render(totals, gauges)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("offline_user_rows_total", (("priority", "high"), ("user", "alice")))] == 40
    assert samples[("offline_user_rows_total", (("priority", "normal"), ("user", "bob")))] == 7
    assert samples[("offline_queued_rows", (("priority", "high"), ("user", "alice")))] == 60
    assert [k for k in samples if k[0] == "offline_queued_rows"] == [
        ("offline_queued_rows", (("priority", "high"), ("user", "alice")))
    ]
    assert "# TYPE offline_user_rows_total counter" in text and "# TYPE offline_queued_rows gauge" in text


@pytest.mark.parametrize(
    ("outcome", "status"),
    [("ok", "2xx"), ("400", "4xx"), ("413", "4xx"), ("429", "429"), ("503_backlog_full", "503"),
     ("503_broker_unavailable", "503"), ("504", "504"), ("500", "5xx")],
)  # fmt: skip
def test_each_outcome_has_its_status_class(outcome, status):
    assert metrics.status_class(outcome) == status
    assert metrics.request_fields("m", outcome, {})[f"status|{status}"] == 1


def test_accumulator_sums_per_second_and_writes_both_hashes_in_one_flush(redis_url, redis_client):
    import asyncio

    import redis.asyncio as aredis

    accumulator = metrics.Accumulator()
    second = 1_700_000_000
    accumulator.add({"req|acc|ok": 1, "latsum|acc|total": 0.25}, now=second + 0.1)
    accumulator.add({"req|acc|ok": 1, "latsum|acc|total": 0.5}, now=second + 0.9)
    accumulator.add({"req|acc|503_deadline": 1}, now=second + 1.2)
    before = float(redis_client.hget(TOTAL_KEY, "req|acc|ok") or 0)

    async def flush() -> None:
        client = aredis.Redis.from_url(redis_url)
        await accumulator.aflush(client)
        await client.aclose()

    asyncio.run(flush())
    assert not accumulator
    first = redis_client.hgetall(second_key(second))
    assert first["req|acc|ok"] == "2" and float(first["latsum|acc|total"]) == pytest.approx(0.75)
    assert redis_client.hget(second_key(second + 1), "req|acc|503_deadline") == "1"
    assert float(redis_client.hget(TOTAL_KEY, "req|acc|ok")) == before + 2
