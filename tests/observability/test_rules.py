"""Each troubleshooting rule on figures made for it: the symptom it names, and its near misses."""

from __future__ import annotations

from inference.web import diagnosis as online
from jobs.monitoring import offline_stalled
from observability.diagnosis import Snapshot, diagnose, report
from observability.rules import host_is_saturated, host_saturated


def healthy(**changes) -> Snapshot:
    base = dict(
        window_s=60, requests_per_s=40, ok_per_s=40, p50_s=0.05, p99_s=0.09, inference_p50_s=0.02,
        queue_wait_p50_s=0.003, batch_wait_p50_s=0.004, mean_batch_size=2.0, mean_fill=0.1,
        online_backlog=[1.0] * 60, online_in_flight=3, online_workers_now=2, online_workers_min=2,
        online_workers_series=[2.0] * 60, ok_series=[40.0] * 60, busy_fraction=0.7, worker_cpu_pct=70,
        host_cpu_pct=60.0, host_load1=1.2, host_cores=2,
    )  # fmt: skip
    base.update(changes)
    return Snapshot(**base)


def rules(snapshot: Snapshot) -> list[str]:
    return [f.rule for f in diagnose(snapshot)]


def test_healthy_figures_say_no_jam():
    assert rules(healthy()) == []
    text = report(healthy())
    assert text.startswith("no jam: last 60 s: 40.0 requests/s")
    assert "host CPU 60% load 1.2 on 2 cores" in text


# backlog_growing ------------------------------------------------------------------------------


def test_a_growing_backlog_is_named():
    found = online.backlog_growing(healthy(online_backlog=[float(i) for i in range(60)]))
    assert found is not None and found.rule == "backlog_growing"
    assert "online backlog 0 -> 59 requests over 60 s (rising for 20 s)" in found.evidence


def test_a_step_when_load_starts_is_not_a_growing_backlog():
    assert online.backlog_growing(healthy(online_backlog=[0.0] * 20 + [16.0] * 40)) is None
    # The step seen 6 s after it (the window's second half all rising before): still only one jump.
    assert online.backlog_growing(healthy(online_backlog=[0.0] * 54 + [10.0, 20.0] + [20.0] * 4)) is None
    # A ramp as clients join over 10 s, then a plateau: bounded, nothing refused.
    assert (
        online.backlog_growing(healthy(online_backlog=[0.0] * 40 + [2.0 * i for i in range(10)] + [20.0] * 10)) is None
    )


def test_a_backlog_that_nothing_drains_is_named():
    stalled = healthy(online_backlog=[12.0] + [24.0] * 59, ok_series=[40.0] * 54 + [0.0] * 6, ok_per_s=36.0)
    found = online.backlog_growing(stalled)
    assert found is not None and "not rising" in found.evidence and "(0 in the last 5 s)" in found.evidence
    # Short windows (`diagnose --window-s 6`) have no series to look into: the window's rate decides.
    assert online.backlog_growing(healthy(online_backlog=[24.0] * 6, ok_series=[], ok_per_s=0.0, window_s=6))


def test_a_backlog_at_its_bound_is_named():
    assert online.backlog_growing(healthy(refusals_per_s={"backlog_full": 3.0})) is not None


def test_sustained_growth_needs_each_block_to_rise():
    assert online.sustained_growth([float(i) for i in range(25)])
    assert not online.sustained_growth([float(i) for i in range(24)])  # too short to tell
    assert not online.sustained_growth([0.0] * 5 + [1.0] * 5 + [2.0] * 5 + [3.0] * 5 + [3.0] * 5)


def test_a_ramp_seen_at_its_end_is_not_growth():
    # Clients joining over 10 s, the window ending as the last one joins: two rising blocks, not four.
    assert online.backlog_growing(healthy(online_backlog=[0.0] * 50 + [2.0 * i for i in range(10)])) is None


# workers_missing ------------------------------------------------------------------------------


def test_missing_or_restarting_workers():
    assert online.workers_missing(healthy(online_workers_now=0, online_workers_min=0)) is not None
    restarted = [2.0] * 30 + [1.0] * 5 + [2.0] * 25  # a child died and was replaced
    found = online.workers_missing(healthy(online_workers_min=1, online_workers_series=restarted))
    assert found is not None and "2 online worker children alive now, as few as 1" in found.evidence
    assert online.workers_missing(healthy()) is None


def test_workers_starting_are_not_workers_missing():
    # A fresh start (or a scale-up) seen in the window: the count only rose. The dashboard said
    # "workers missing or restarting" for the first minute after every start.
    starting = [0.0] * 20 + [1.0] * 20 + [2.0] * 20
    assert online.workers_missing(healthy(online_workers_min=0, online_workers_series=starting)) is None


# idle_but_slow and host_saturated ---------------------------------------------------------------


def test_latency_high_while_workers_idle_is_a_lock():
    found = diagnose(healthy(p99_s=1.2, busy_fraction=0.1))
    assert [f.rule for f in found] == ["idle_but_slow"]
    assert "P99 1200 ms while online children were busy 10%" in found[0].evidence
    assert "host CPU 60%, not saturated" in found[0].evidence


def test_a_saturated_host_is_not_a_lock():
    starved = healthy(p99_s=1.2, busy_fraction=0.3, host_cpu_pct=99.0, host_load1=9.5, host_cores=2)
    assert host_is_saturated(starved)
    assert online.idle_but_slow(starved) is None
    assert rules(starved) == ["host_saturated"]
    assert "host CPU 99% busy, load 9.5 on 2 cores" in host_saturated(starved).evidence


def test_a_busy_host_that_answers_fast_is_no_finding():
    assert host_saturated(healthy(host_cpu_pct=99.0, host_load1=4.0)) is None


def test_a_busy_host_with_load_within_its_cores_is_not_saturated():
    assert not host_is_saturated(healthy(host_cpu_pct=95.0, host_load1=1.8, host_cores=2))
    assert not host_is_saturated(healthy(host_cpu_pct=None, host_load1=None))


# compute_saturated ----------------------------------------------------------------------------


def test_busy_workers_with_high_latency_are_compute_bound():
    found = diagnose(healthy(busy_fraction=0.95, p99_s=2.2, timeouts_per_s=0.15))
    assert [f.rule for f in found] == ["compute_saturated"]
    assert "busy 95% of the time, P99 2200 ms" in found[0].evidence
    assert online.compute_saturated(healthy(busy_fraction=0.95, p99_s=0.3)) is None


# batches_not_filling --------------------------------------------------------------------------


def test_batches_not_filling_when_requests_waited_for_passes():
    found = online.batches_not_filling(
        healthy(mean_batch_size=1.0, queue_wait_p50_s=0.08, batch_wait_p50_s=0.01, inference_p50_s=0.02)
    )
    assert found is not None and "over 4.5 passes of 20 ms" in found.evidence


def test_small_passes_that_took_all_that_waited_are_no_finding():
    # 8 steady clients on 2 children: passes of 1-2 texts, each request picked up within a pass.
    assert online.batches_not_filling(healthy(online_backlog=[6.0] * 60, mean_batch_size=1.2)) is None
    assert (
        online.batches_not_filling(healthy(mean_batch_size=1.0, queue_wait_p50_s=None, batch_wait_p50_s=None)) is None
    )


def test_waiting_behind_the_passes_of_its_own_dispatch_is_not_waiting_for_company():
    # Issue 23: a dispatch of a few texts of mixed lengths is cut into passes by max_padding_fraction; a
    # text in the last pass waits for the others (pass_wait). That is batching by length, not a request
    # left alone: before the split, this wait was in batch_wait and the rule fired at a steady 8 clients.
    steady = healthy(
        mean_batch_size=1.3, queue_wait_p50_s=0.002, batch_wait_p50_s=0.004, pass_wait_p50_s=0.05, inference_p50_s=0.02
    )
    assert online.batches_not_filling(steady) is None
    # The same figures with that wait still counted as batch_wait are the finding the old timing produced.
    before = healthy(mean_batch_size=1.3, queue_wait_p50_s=0.002, batch_wait_p50_s=0.054, inference_p50_s=0.02)
    assert online.batches_not_filling(before) is not None


def test_a_dispatch_that_merged_requests_is_batching_however_small_its_passes():
    # Issue 23: at a steady 8 clients on 2 saturated CPU children, requests wait for a free child (batch_wait,
    # several passes' worth), each dispatch merges several of them, and the length rule runs them as passes
    # of 1 or 2 texts. More prefetch or a longer batch wait would change nothing: no finding.
    saturated = healthy(
        mean_batch_size=1.2, mean_dispatch_size=5.5, queue_wait_p50_s=0.001, batch_wait_p50_s=0.13, inference_p50_s=0.02
    )
    assert online.batches_not_filling(saturated) is None
    # Dispatches of one text while requests waited that long: the dispatcher is not merging them.
    found = online.batches_not_filling(
        healthy(mean_batch_size=1.0, mean_dispatch_size=1.0, queue_wait_p50_s=0.12, inference_p50_s=0.02)
    )
    assert found is not None and "dispatches hold 1.00 texts" in found.evidence


# many_refusals ----------------------------------------------------------------------------------


def test_refusals_at_the_bound_are_backlog_and_capacity():
    found = rules(healthy(refusals_per_s={"backlog_full": 10.0}, requests_per_s=50))
    assert found == ["backlog_growing", "many_refusals"]
    assert online.many_refusals(healthy(refusals_per_s={"deadline": 1.0}, requests_per_s=50)) is None  # 2%


# cpu_bound_gpu_idle ---------------------------------------------------------------------------


def test_cpu_bound_while_gpu_idles_only_with_a_gpu():
    assert rules(healthy(worker_cpu_pct=98, gpu_util_pct=12.0)) == ["cpu_bound_gpu_idle"]
    unevaluated = online.cpu_bound_gpu_idle(healthy(worker_cpu_pct=98, gpu_util_pct=None, gpu_status="cpu device"))
    assert unevaluated.why == "no GPU figures: cpu device"
    assert rules(healthy(worker_cpu_pct=98, gpu_util_pct=None)) == []


# memory_growing ---------------------------------------------------------------------------------


def test_latency_growing_with_memory():
    found = rules(healthy(rss_mb_start=800, rss_mb_end=1200, p50_start_s=0.05, p50_end_s=0.2))
    assert found == ["memory_growing"]
    assert rules(healthy(rss_mb_start=800, rss_mb_end=820, p50_start_s=0.05, p50_end_s=0.2)) == []


# shared_dependency ------------------------------------------------------------------------------


def scaled_out(**changes) -> Snapshot:
    """Children 2 -> 4 across the window, answers flat at 150/s, 20 requests waiting throughout."""
    base = dict(
        online_workers_series=[2.0] * 20 + [3.0] * 20 + [4.0] * 20,
        online_workers_now=4,
        online_workers_min=2,
        ok_series=[150.0] * 60,
        online_backlog=[20.0] * 60,
        busy_fraction=0.4,
    )
    base.update(changes)
    return healthy(**base)


def test_scaled_out_but_flat_names_a_shared_dependency():
    found = online.shared_dependency(scaled_out())
    assert found is not None and found.rule == "shared_dependency"
    assert "online children 2 -> 4 across 60 s while answers went 150.0 -> 150.0/s" in found.evidence
    assert "Redis" in found.action and "database" in found.action


def test_scaled_out_and_throughput_followed_is_no_finding():
    assert online.shared_dependency(scaled_out(ok_series=[150.0] * 20 + [220.0] * 20 + [290.0] * 20)) is None


def test_scaled_out_after_the_load_left_is_no_finding():
    assert online.shared_dependency(scaled_out(online_backlog=[20.0] * 20 + [2.0] * 40)) is None


def test_scaled_out_on_a_saturated_host_is_the_host():
    assert online.shared_dependency(scaled_out(host_cpu_pct=99.0, host_load1=8.0)) is None


def test_no_scale_out_is_no_finding():
    assert online.shared_dependency(healthy(online_backlog=[20.0] * 60)) is None


# offline_stalled (registered by jobs) -------------------------------------------------------------


def test_offline_chunks_with_no_offline_worker():
    stalled = healthy(gauges={"gauge|offline|waiting": 12.0, "gauge|workers|offline": 0.0})
    assert offline_stalled(stalled).evidence == "12 chunks queued, 0 offline worker children alive"
    assert "offline_stalled" in rules(stalled)
    assert offline_stalled(healthy(gauges={"gauge|offline|waiting": 12.0, "gauge|workers|offline": 1.0})) is None
    assert offline_stalled(healthy(gauges={"gauge|offline|waiting": 0.0, "gauge|workers|offline": 0.0})) is None


# the online figures the rules read ------------------------------------------------------------------


def test_online_figures_come_from_the_sampled_gauges_and_heartbeats():
    seconds = [
        {"gauge|online|waiting": 1.0, "gauge|online|in_flight": 4.0, "gauge|workers|online": 2.0},
        {"req|router|ok": 3.0},  # a second the sampler missed
        {"gauge|online|waiting": 0.0, "gauge|online|in_flight": 9.0, "gauge|workers|online": 1.0},
    ]
    workers = [{"cpu_pct": 80.0, "gpu": "cpu device"}, {"cpu_pct": 40.0, "gpu": "cpu device"}]
    s = Snapshot(window_s=3)
    online.fill_online(s, seconds, workers)
    assert s.online_backlog == [5.0, 9.0] and s.online_in_flight == 9.0
    assert s.online_workers_series == [2.0, 1.0] and s.online_workers_min == 1 and s.online_workers_now == 2
    assert s.worker_cpu_pct == 60.0 and s.gpu_util_pct is None
    assert s.gpu_status == "2 online child(ren): cpu device"
