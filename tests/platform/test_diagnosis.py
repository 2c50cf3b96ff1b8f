"""Each troubleshooting rule, on figures that show its symptom, and 'no jam' on healthy ones."""

from __future__ import annotations

from platform_.diagnosis import Snapshot, diagnose, report


def healthy(**changes) -> Snapshot:
    base = dict(
        window_s=60, requests_per_s=40, ok_per_s=40, p50_s=0.05, p99_s=0.09, inference_p50_s=0.02, mean_batch_size=2.0,
        mean_fill=0.1, online_backlog=[1.0] * 60, online_in_flight=3, online_workers_now=2, online_workers_min=2,
        busy_fraction=0.7, worker_cpu_pct=70,
    )  # fmt: skip
    base.update(changes)
    return Snapshot(**base)


def rules(snapshot: Snapshot) -> list[str]:
    return [f.rule for f in diagnose(snapshot)]


def test_healthy_figures_say_no_jam():
    assert rules(healthy()) == []
    assert report(healthy()).startswith("no jam: last 60 s: 40.0 requests/s")


def test_a_growing_backlog_is_named():
    found = diagnose(healthy(online_backlog=[float(i) for i in range(60)], p99_s=0.4, busy_fraction=0.98))
    assert [f.rule for f in found] == ["backlog_growing"]
    assert "online backlog 0 -> 59 requests over 60 s" in found[0].evidence


def test_a_step_when_load_starts_is_not_a_growing_backlog():
    assert rules(healthy(online_backlog=[0.0] * 20 + [16.0] * 40)) == []


def test_a_backlog_that_nothing_drains_is_named():
    found = diagnose(healthy(online_backlog=[12.0, 24.0, 24.0, 24.0, 24.0, 24.0], ok_per_s=0.0, window_s=6))
    assert "backlog_growing" in [f.rule for f in found]


def test_busy_workers_with_high_latency_are_compute_bound():
    found = diagnose(healthy(busy_fraction=0.95, p99_s=2.2, timeouts_per_s=0.15))
    assert [f.rule for f in found] == ["compute_saturated"]
    assert "busy 95% of the time, P99 2200 ms" in found[0].evidence
    assert rules(healthy(busy_fraction=0.95, p99_s=0.3)) == []


def test_refusals_at_the_bound_are_backlog_and_capacity():
    found = rules(healthy(refusals_per_s={"backlog_full": 10.0}, requests_per_s=50))
    assert found == ["backlog_growing", "many_refusals"]


def test_latency_high_while_workers_idle():
    found = diagnose(healthy(p99_s=1.2, busy_fraction=0.1))
    assert [f.rule for f in found] == ["idle_but_slow"]
    assert "P99 1200 ms while online children were busy 10%" in found[0].evidence


def test_missing_or_restarting_workers():
    assert "workers_missing" in rules(healthy(online_workers_now=0, online_workers_min=0, busy_fraction=None))
    assert "workers_missing" in rules(healthy(online_workers_min=1))


def test_batches_not_filling():
    assert rules(healthy(online_backlog=[6.0] * 60, mean_batch_size=1.0)) == ["batches_not_filling"]


def test_cpu_bound_while_gpu_idles_only_with_a_gpu():
    assert rules(healthy(worker_cpu_pct=98, gpu_util_pct=12.0)) == ["cpu_bound_gpu_idle"]
    assert rules(healthy(worker_cpu_pct=98, gpu_util_pct=None)) == []


def test_latency_growing_with_memory():
    found = rules(healthy(rss_mb_start=800, rss_mb_end=1200, p50_start_s=0.05, p50_end_s=0.2))
    assert found == ["memory_growing"]
    assert rules(healthy(rss_mb_start=800, rss_mb_end=820, p50_start_s=0.05, p50_end_s=0.2)) == []
