"""Names the jam: the article's troubleshooting table as rules over live figures.

`snapshot()` reads the figures (metrics, heartbeats, drain-rate buckets); `diagnose()` is a pure
function of them, so each rule is tested on figures made for it. `python manage.py diagnose` and the
dashboard print the same verdict.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from django.conf import settings

from inference.workers import WORKERS_KEY, alive_workers, rate_key
from platform_ import metrics


@dataclass
class Snapshot:
    """The figures the rules read, over the last `window_s` seconds."""

    window_s: int
    requests_per_s: float = 0.0
    ok_per_s: float = 0.0
    refusals_per_s: dict[str, float] = field(default_factory=dict)
    timeouts_per_s: float = 0.0
    p50_s: float | None = None
    p95_s: float | None = None
    p99_s: float | None = None
    offline_rows_per_s: float = 0.0
    inference_p50_s: float | None = None
    mean_batch_size: float | None = None
    mean_fill: float | None = None
    # Online requests admitted (waiting in the broker plus buffered or running in a worker), one
    # sample per second, oldest first. The broker list alone stays near empty: workers prefetch.
    online_backlog: list[float] = field(default_factory=list)
    online_in_flight: float = 0.0
    online_workers_now: int = 0
    online_workers_min: int = 0  # fewest alive during the window
    busy_fraction: float | None = None  # share of child-time spent running batches
    worker_cpu_pct: float = 0.0  # per online child, on average
    gpu_util_pct: float | None = None
    # Why there is no GPU figure, from the online children's heartbeats ("cpu device", "none (no NVIDIA driver ...)").
    gpu_status: str | None = None
    rss_mb_start: float | None = None  # online children's total memory, a long window apart
    rss_mb_end: float | None = None
    p50_start_s: float | None = None
    p50_end_s: float | None = None


@dataclass(frozen=True)
class Finding:
    rule: str
    symptom: str
    evidence: str
    action: str


@dataclass(frozen=True)
class Unevaluated:
    """A rule whose figures are missing: said aloud, so that it is not mistaken for a rule that held no jam."""

    rule: str
    symptom: str
    why: str


def _slope_per_s(samples: list[float]) -> float:
    """Least-squares slope of evenly spaced samples, per sample."""
    n = len(samples)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(samples) / n
    num = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(samples))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def diagnose(s: Snapshot) -> list[Finding]:
    """Every troubleshooting row that holds now, with its evidence; empty means no jam."""
    found: list[Finding] = []
    waiting_now = s.online_backlog[-1] if s.online_backlog else 0.0
    # Growth over the window's second half: a step when load starts is not a backlog that grows.
    slope = _slope_per_s(s.online_backlog[len(s.online_backlog) // 2 :])
    refused = sum(s.refusals_per_s.values())
    not_draining = waiting_now >= 5 and s.ok_per_s == 0

    if (slope > 0.2 and waiting_now >= 5) or not_draining or s.refusals_per_s.get("backlog_full", 0) > 0:
        first = s.online_backlog[0] if s.online_backlog else 0.0
        found.append(
            Finding(
                "backlog_growing",
                "backlog grows over time (queue unbounded or under-provisioned)",
                f"online backlog {first:.0f} -> {waiting_now:.0f} requests over {s.window_s} s (+{slope:.2f}/s), "
                f"backlog_full refusals {s.refusals_per_s.get('backlog_full', 0):.2f}/s, {s.ok_per_s:.1f} answered/s",
                "add online worker children or hosts (scale on queue depth, not CPU); keep ONLINE_MAX_BACKLOG bounded",
            )
        )
    if s.online_workers_now == 0 or s.online_workers_min < s.online_workers_now:
        found.append(
            Finding(
                "workers_missing",
                "workers missing or restarting",
                f"{s.online_workers_now} online worker children alive now, as few as {s.online_workers_min} in the last {s.window_s} s",
                "check the online worker's log for crashes, OOM kills or model load failures (worker_proc_alive_timeout)",
            )
        )
    if (
        s.p99_s is not None
        and s.p99_s > 0.5
        and s.busy_fraction is not None
        and s.busy_fraction < 0.5
        and s.online_workers_now > 0
    ):
        found.append(
            Finding(
                "idle_but_slow",
                "latency high while workers idle (lock or dispatch problem)",
                f"P99 {_ms(s.p99_s)} while online children were busy {s.busy_fraction * 100:.0f}% of the time; "
                f"inference P50 {_ms(s.inference_p50_s)}",
                "profile the web tier and the worker's main process (py-spy): look for a lock, a blocking call or "
                "a dispatch that waits",
            )
        )
    if (
        s.busy_fraction is not None
        and s.busy_fraction >= 0.85
        and ((s.p99_s is not None and s.p99_s >= 1.0) or s.timeouts_per_s > 0)
    ):
        found.append(
            Finding(
                "compute_saturated",
                "workers busy and latency high (model compute is the bottleneck)",
                f"online children busy {s.busy_fraction * 100:.0f}% of the time, P99 {_ms(s.p99_s)}, "
                f"{s.timeouts_per_s:.2f} timeouts/s at {s.ok_per_s:.1f} answered/s",
                "add worker children, hosts or a GPU; on a GPU raise max_batch_size; or shed load sooner with a "
                "shorter ONLINE_DEADLINE_MS or a smaller ONLINE_MAX_BACKLOG",
            )
        )
    if waiting_now >= 2 and s.mean_batch_size is not None and s.mean_batch_size <= 1.5:
        found.append(
            Finding(
                "batches_not_filling",
                "batches not filling (window too short or prefetch too small)",
                f"{waiting_now:.0f} requests waiting but passes hold {s.mean_batch_size:.2f} texts on average "
                f"(fill {(s.mean_fill or 0) * 100:.0f}%)",
                "raise the online worker's --prefetch-multiplier, or ONLINE_BATCH_WAIT_MS on a GPU",
            )
        )
    if s.requests_per_s > 0 and refused / s.requests_per_s >= 0.05:
        reasons = ", ".join(f"{k} {v:.2f}/s" for k, v in sorted(s.refusals_per_s.items()) if v)
        found.append(
            Finding(
                "many_refusals",
                "many refusals (capacity)",
                f"{refused:.2f} refusals/s of {s.requests_per_s:.2f} requests/s ({refused / s.requests_per_s * 100:.0f}%): {reasons}",
                "add capacity, or ask clients to honour Retry-After and spread their load",
            )
        )
    if s.gpu_util_pct is not None and s.worker_cpu_pct >= 90 and s.gpu_util_pct < 30:
        found.append(
            Finding(
                "cpu_bound_gpu_idle",
                "CPU saturated while the accelerator idles (pre-processing bound)",
                f"online children at {s.worker_cpu_pct:.0f}% CPU each, GPU {s.gpu_util_pct:.0f}% busy",
                "move tokenization out of the hot loop, raise batch sizes, give children more CPU threads",
            )
        )
    if (
        None not in (s.rss_mb_start, s.rss_mb_end, s.p50_start_s, s.p50_end_s)
        and s.rss_mb_start
        and s.p50_start_s
        and s.rss_mb_end / s.rss_mb_start >= 1.2
        and s.p50_end_s / s.p50_start_s >= 1.5
    ):
        found.append(
            Finding(
                "memory_growing",
                "latency growing with memory (fragmentation or leak)",
                f"online children {s.rss_mb_start:.0f} -> {s.rss_mb_end:.0f} MB while P50 went "
                f"{_ms(s.p50_start_s)} -> {_ms(s.p50_end_s)}",
                "set --max-tasks-per-child, check per-request allocations, preallocate at the largest batch shape",
            )
        )
    return found


def not_evaluated(s: Snapshot) -> list[Unevaluated]:
    """Rules that could not be evaluated on these figures (today: the GPU rule on a host without GPU figures)."""
    if s.gpu_util_pct is not None:
        return []
    why = s.gpu_status or "no online child reports GPU figures"
    return [Unevaluated("cpu_bound_gpu_idle", "CPU saturated while the accelerator idles", f"no GPU figures: {why}")]


def summary(s: Snapshot) -> str:
    return (
        f"last {s.window_s} s: {s.requests_per_s:.1f} requests/s ({s.ok_per_s:.1f} ok), P50 {_ms(s.p50_s)}, "
        f"P99 {_ms(s.p99_s)}, mean batch {s.mean_batch_size or 0:.2f}, online backlog "
        f"{(s.online_backlog or [0])[-1]:.0f} ({s.online_in_flight:.0f} in a worker), "
        f"{s.online_workers_now} online children, busy {(s.busy_fraction or 0) * 100:.0f}%"
    )


def report(s: Snapshot) -> str:
    """The verdict as text: each finding with evidence and action, or 'no jam' with the figures."""
    findings = diagnose(s)
    lines = [f"{len(findings)} finding(s); {summary(s)}" if findings else f"no jam: {summary(s)}"]
    for f in findings:
        lines += [f"- {f.symptom} [{f.rule}]", f"    evidence: {f.evidence}", f"    action:   {f.action}"]
    lines += [f"not evaluated: {u.symptom} [{u.rule}]: {u.why}" for u in not_evaluated(s)]
    return "\n".join(lines)


def gpu_status(workers: list[dict]) -> str:
    """Why the online children give no GPU figures, each reason with how many children gave it."""
    if not workers:
        return "no online child alive"
    reasons: dict[str, int] = {}
    for w in workers:
        reason = w.get("gpu") or "no `gpu` field (a worker from before GPU reporting)"
        reasons[reason] = reasons.get(reason, 0) + 1
    return "; ".join(f"{n} online child(ren): {reason}" for reason, n in sorted(reasons.items()))


def snapshot(client, window_s: int = 60, trend_s: int = 900) -> Snapshot:
    """Read the figures from Redis: metrics of the window, heartbeats, drain-rate buckets, and a trend span."""
    now = time.time()
    seconds = metrics.read_seconds(client, window_s, now)
    w = metrics.Window(seconds=window_s)
    for bucket in seconds:
        for name, value in bucket.items():
            if not name.startswith("gauge|"):
                w.counters[name] = w.counters.get(name, 0.0) + value
    s = Snapshot(window_s=window_s)
    s.requests_per_s = w.requests() / window_s
    s.ok_per_s = w.requests(outcome="ok") / window_s
    s.refusals_per_s = {
        name.split("|")[2].removeprefix("503_"): value / window_s
        for name, value in w.matching("req|").items()
        if name.split("|")[2].startswith("503_")
    }
    s.timeouts_per_s = w.requests(outcome="504") / window_s
    s.p50_s, s.p95_s, s.p99_s = (w.percentile_s("total", pct) for pct in (50, 95, 99))
    s.offline_rows_per_s = sum(w.matching("orows|").values()) / window_s
    s.inference_p50_s = w.percentile_s("inference", 50)
    s.mean_batch_size, s.mean_fill = w.mean_batch_size(), w.mean_fill()
    s.online_backlog = [
        b["gauge|online|waiting"] + b.get("gauge|online|in_flight", 0.0) for b in seconds if "gauge|online|waiting" in b
    ]
    latest = next((b for b in reversed(seconds) if "gauge|online|in_flight" in b), {})
    s.online_in_flight = latest.get("gauge|online|in_flight", 0.0)
    workers = [
        w_
        for w_ in alive_workers(client.hgetall(WORKERS_KEY), settings.WORKER_HEARTBEAT_S, now)
        if w_["queue"] == "online"
    ]
    s.online_workers_now = len(workers)
    counts = [b["gauge|workers|online"] for b in seconds if "gauge|workers|online" in b]
    s.online_workers_min = int(min(counts + [len(workers)]))
    s.worker_cpu_pct = sum(x.get("cpu_pct", 0.0) for x in workers) / len(workers) if workers else 0.0
    gpu = [x["gpu_util_pct"] for x in workers if x.get("gpu_util_pct") is not None]
    s.gpu_util_pct = sum(gpu) / len(gpu) if gpu else None
    if not gpu:
        s.gpu_status = gpu_status(workers)
    busy_s = 0.0
    pipe = client.pipeline(transaction=False)
    for model in {m for x in workers for m in x["models"]}:
        for offset in range(window_s):
            pipe.hget(rate_key(model, int(now) - offset), "busy_s")
    busy_s = sum(float(v) for v in pipe.execute() if v)
    s.busy_fraction = busy_s / (window_s * len(workers)) if workers else None
    # Trend: the first and last minutes of the longer span, for memory and median latency.
    trend = metrics.read_seconds(client, trend_s, now, fields=["gauge|rss_mb|online"])
    rss = [b["gauge|rss_mb|online"] for b in trend if b]
    if len(rss) >= 2 and len(trend) >= trend_s // 2:
        s.rss_mb_start, s.rss_mb_end = rss[0], rss[-1]
        s.p50_start_s = metrics.window(client, 60, now - trend_s + 60).percentile_s("total", 50)
        s.p50_end_s = s.p50_s
    return s
