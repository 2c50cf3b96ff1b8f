"""The online path's rows of the troubleshooting table, each a small rule, and the figures they read.

Registered with observability in InferenceConfig.ready(). Each rule is a pure function of a
`Snapshot`; thresholds are named here with why they sit where they do (docs/observability.md).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from inference.core.keys import WORKERS_KEY, rate_key
from inference.core.workers import alive_workers
from observability import metrics
from observability.diagnosis import Finding, Snapshot, Unevaluated, ms
from observability.rules import host_is_saturated

# Backlog growth is named when the admitted backlog rose in each of GROWTH_BLOCKS consecutive
# blocks of GROWTH_BLOCK_S seconds: a backlog that grows keeps growing; a load step (clients
# arriving) jumps once and then holds, however steep the jump.
GROWTH_BLOCK_S = 5
GROWTH_BLOCKS = 4
BACKLOG_MIN = 5  # fewer requests waiting is no jam, whatever the trend
STALL_S = 5  # requests waiting and none answered for this long: the backlog is not draining
# Dispatches of this many texts or fewer on average count as "not filling" ...
SMALL_PASS_TEXTS = 1.5
# ... but only when requests waited longer than this many passes before theirs: otherwise each pass
# took what was waiting, and small passes only mean little was waiting (a light or closed-loop load).
WAITED_PASSES = 2.0
# A request P99 above this with children idle more than half the time: something other than compute.
IDLE_BUT_SLOW_P99_S = 0.5
IDLE_BUSY_FRACTION = 0.5
# Children busy this share of their time with a P99 of a second or timeouts: compute is the limit.
SATURATED_BUSY_FRACTION = 0.85
SATURATED_P99_S = 1.0
REFUSED_SHARE = 0.05
# Scaled out but flat: children grew by this factor across the window while answers rose less than this.
SCALE_OUT_FACTOR = 1.5
FLAT_GAIN = 1.15
GPU_BUSY_PCT = 85.0
TREND_S = 900


def sustained_growth(samples: list[float], block_s: int = GROWTH_BLOCK_S, blocks: int = GROWTH_BLOCKS) -> bool:
    """True when each of the last `blocks` blocks' mean exceeds the one before by at least 1 request and 5%."""
    if len(samples) < block_s * (blocks + 1):
        return False
    tail = samples[-block_s * (blocks + 1) :]
    means = [sum(tail[i : i + block_s]) / block_s for i in range(0, len(tail), block_s)]
    return all(b - a >= max(1.0, 0.05 * a) for a, b in zip(means, means[1:], strict=False))


def _thirds(samples: list[float]) -> tuple[float, float] | None:
    """Means of the first and last thirds of the samples (None with fewer than 6)."""
    if len(samples) < 6:
        return None
    n = len(samples) // 3
    return sum(samples[:n]) / n, sum(samples[-n:]) / n


def backlog_growing(s: Snapshot) -> Finding | None:
    """The article's "latency grows linearly with time": an unbounded or under-provisioned queue."""
    waiting_now = s.online_backlog[-1] if s.online_backlog else 0.0
    # Refused at the bound (requests or tokens) or because the wait behind it passed the deadline's share.
    at_bound = sum(s.refusals_per_s.get(reason, 0.0) for reason in ("backlog_full", "deadline"))
    growing = waiting_now >= BACKLOG_MIN and sustained_growth(s.online_backlog)
    # Nothing answered lately (the window's last seconds: a stall is news before the minute's mean knows it).
    recent_ok = sum(s.ok_series[-STALL_S:]) if len(s.ok_series) >= STALL_S else s.ok_per_s
    not_draining = waiting_now >= BACKLOG_MIN and recent_ok == 0
    if not (growing or not_draining or at_bound > 0):
        return None
    first = s.online_backlog[0] if s.online_backlog else 0.0
    return Finding(
        "backlog_growing",
        "backlog grows over time (queue unbounded or under-provisioned)",
        f"online backlog {first:.0f} -> {waiting_now:.0f} requests over {s.window_s} s "
        f"({'rising for ' + str(GROWTH_BLOCK_S * GROWTH_BLOCKS) + ' s' if growing else 'not rising'}), "
        f"refused at the bound (backlog_full, deadline) {at_bound:.2f}/s, {s.ok_per_s:.1f} answered/s "
        f"({recent_ok:.0f} in the last {STALL_S} s)",
        "add online worker children or hosts (scale on queue depth, not CPU); keep ONLINE_MAX_BACKLOG bounded",
    )


def workers_missing(s: Snapshot) -> Finding | None:
    """Timeouts now and then, gone after a restart: children dying or restarting.

    A restart is a fall in the count of children alive: fewer than there had been earlier in the
    window. A rise alone is children starting (a fresh start, a scale-up), not a fault.
    """
    series = [*s.online_workers_series, float(s.online_workers_now)]
    fell = any(count < max(series[:i]) for i, count in enumerate(series) if i)
    if not (s.online_workers_now == 0 or fell):
        return None
    return Finding(
        "workers_missing",
        "workers missing or restarting",
        f"{s.online_workers_now} online worker children alive now, as few as {s.online_workers_min} "
        f"in the last {s.window_s} s",
        "check the online worker's log for crashes, OOM kills or model load failures (worker_proc_alive_timeout)",
    )


def idle_but_slow(s: Snapshot) -> Finding | None:
    """The article's "neither CPU nor GPU full but latency high": a lock, a blocking call, dispatch.

    Not when the host is saturated: then the children are idle because they wait for a core, and
    `host_saturated` says so (10 children on a 2-core host looked exactly like a lock).
    """
    if (
        s.p99_s is None
        or s.p99_s <= IDLE_BUT_SLOW_P99_S
        or s.busy_fraction is None
        or s.busy_fraction >= IDLE_BUSY_FRACTION
        or s.online_workers_now == 0
        or host_is_saturated(s)
    ):
        return None
    return Finding(
        "idle_but_slow",
        "latency high while workers idle (lock or dispatch problem)",
        f"P99 {ms(s.p99_s)} while online children were busy {s.busy_fraction * 100:.0f}% of the time; "
        f"inference P50 {ms(s.inference_p50_s)}"
        + ("" if s.host_cpu_pct is None else f"; host CPU {s.host_cpu_pct:.0f}%, not saturated"),
        "profile the web tier and the worker's main process (py-spy): look for a lock, a blocking call or "
        "a dispatch that waits",
    )


def compute_saturated(s: Snapshot) -> Finding | None:
    """The article's "GPU busy and latency still high": model compute is the bottleneck."""
    slow = (s.p99_s is not None and s.p99_s >= SATURATED_P99_S) or s.timeouts_per_s > 0
    if s.busy_fraction is None or s.busy_fraction < SATURATED_BUSY_FRACTION or not slow:
        return None
    return Finding(
        "compute_saturated",
        "workers busy and latency high (model compute is the bottleneck)",
        f"online children busy {s.busy_fraction * 100:.0f}% of the time, P99 {ms(s.p99_s)}, "
        f"{s.timeouts_per_s:.2f} timeouts/s at {s.ok_per_s:.1f} answered/s",
        "add worker children, hosts or a GPU; on a GPU raise max_batch_size; or shed load sooner with a "
        "shorter ONLINE_DEADLINE_MS or a smaller ONLINE_MAX_BACKLOG",
    )


def batches_not_filling(s: Snapshot) -> Finding | None:
    """Requests waited for several passes while dispatches held one text: dispatch is not merging them.

    Small batches alone are no finding: under a light or closed-loop load each dispatch takes all that
    waits, and what waits is one request (8 steady clients on 2 children fired the old rule).
    The wait counted is before a request's dispatch starts (queue_wait + batch_wait). The passes its
    own dispatch is cut into (max_padding_fraction) are pass_wait, and are not counted: a dispatch of
    8 texts of mixed lengths run as 5 passes is batching by length, and at a steady 8 clients it read as
    "waited 3 passes" (issue 23). For the same reason the size that counts is the dispatch's, not the
    pass's: a dispatch that merged 8 requests and runs them as passes of 1 or 2 texts is batching, and
    more prefetch would change nothing. (A window recorded before dispatches were counted falls back
    to the pass size.)
    """
    waited = [v for v in (s.queue_wait_p50_s, s.batch_wait_p50_s) if v is not None]
    size = s.mean_dispatch_size if s.mean_dispatch_size is not None else s.mean_batch_size
    if (
        size is None
        or size > SMALL_PASS_TEXTS
        or not waited
        or not s.inference_p50_s
        or sum(waited) < WAITED_PASSES * s.inference_p50_s
    ):
        return None
    return Finding(
        "batches_not_filling",
        "batches not filling (window too short or prefetch too small)",
        f"requests waited {ms(sum(waited))} (P50, queue {ms(s.queue_wait_p50_s)} + buffer "
        f"{ms(s.batch_wait_p50_s)}), over {sum(waited) / s.inference_p50_s:.1f} passes of {ms(s.inference_p50_s)}, "
        f"but {'dispatches' if s.mean_dispatch_size is not None else 'passes'} hold {size:.2f} texts on average "
        f"(fill {(s.mean_fill or 0) * 100:.0f}%)",
        "raise the online worker's --prefetch-multiplier, or ONLINE_BATCH_WAIT_MS on a GPU",
    )


def many_refusals(s: Snapshot) -> Finding | None:
    """Admission refuses a noticeable share: the platform is at its capacity (bounded, as it should be)."""
    refused = sum(s.refusals_per_s.values())
    if s.requests_per_s <= 0 or refused / s.requests_per_s < REFUSED_SHARE:
        return None
    reasons = ", ".join(f"{k} {v:.2f}/s" for k, v in sorted(s.refusals_per_s.items()) if v)
    return Finding(
        "many_refusals",
        "many refusals (capacity)",
        f"{refused:.2f} refusals/s of {s.requests_per_s:.2f} requests/s "
        f"({refused / s.requests_per_s * 100:.0f}%): {reasons}",
        "add capacity, or ask clients to honour Retry-After and spread their load",
    )


def cpu_bound_gpu_idle(s: Snapshot) -> Finding | Unevaluated | None:
    """The article's "GPU low, CPU high": pre-processing, dispatch or data movement is the bottleneck."""
    if s.gpu_util_pct is None:
        why = s.gpu_status or "no online child reports GPU figures"
        return Unevaluated("cpu_bound_gpu_idle", "CPU saturated while the accelerator idles", f"no GPU figures: {why}")
    if s.worker_cpu_pct < 90 or s.gpu_util_pct >= 30:
        return None
    return Finding(
        "cpu_bound_gpu_idle",
        "CPU saturated while the accelerator idles (pre-processing bound)",
        f"online children at {s.worker_cpu_pct:.0f}% CPU each, GPU {s.gpu_util_pct:.0f}% busy",
        "move tokenization out of the hot loop, raise batch sizes, give children more CPU threads",
    )


def memory_growing(s: Snapshot) -> Finding | None:
    """The article's "memory grows slowly, latency jitters": fragmentation or a leak."""
    if (
        None in (s.rss_mb_start, s.rss_mb_end, s.p50_start_s, s.p50_end_s)
        or not s.rss_mb_start
        or not s.p50_start_s
        or s.rss_mb_end / s.rss_mb_start < 1.2
        or s.p50_end_s / s.p50_start_s < 1.5
    ):
        return None
    return Finding(
        "memory_growing",
        "latency growing with memory (fragmentation or leak)",
        f"online children {s.rss_mb_start:.0f} -> {s.rss_mb_end:.0f} MB while P50 went "
        f"{ms(s.p50_start_s)} -> {ms(s.p50_end_s)}",
        "set --max-tasks-per-child, check per-request allocations, preallocate at the largest batch shape",
    )


def shared_dependency(s: Snapshot) -> Finding | None:
    """The article's "scaled out, QPS unchanged": a shared database or Redis is the bottleneck.

    Children grew across the window while answers did not, with work still waiting (so demand was
    there), the host not saturated and the GPU (if any) not busy: what they all share is the limit.
    """
    workers, answered, backlog = (
        _thirds(s.online_workers_series),
        _thirds(s.ok_series),
        _thirds(s.online_backlog),
    )
    if workers is None or answered is None or backlog is None:
        return None
    (w0, w1), (r0, r1), (b0, b1) = workers, answered, backlog
    demand = sum(s.refusals_per_s.values()) > 0 or (b1 >= w1 and b1 >= 0.8 * b0)
    if (
        w0 <= 0
        or w1 < SCALE_OUT_FACTOR * w0
        or r1 >= FLAT_GAIN * r0
        or not demand
        or host_is_saturated(s)
        or (s.gpu_util_pct is not None and s.gpu_util_pct >= GPU_BUSY_PCT)
    ):
        return None
    return Finding(
        "shared_dependency",
        "scaled out but throughput flat (a shared dependency is the bottleneck)",
        f"online children {w0:.0f} -> {w1:.0f} across {s.window_s} s while answers went {r0:.1f} -> {r1:.1f}/s, "
        f"backlog {b0:.0f} -> {b1:.0f}, host CPU " + ("n/a" if s.host_cpu_pct is None else f"{s.host_cpu_pct:.0f}%"),
        "look at what every child shares: Redis (redis-cli --latency, INFO commandstats, its CPU), the database "
        "(pg_stat_activity, slow queries, connections); more children will not help until it is relieved",
    )


# In the order findings are listed.
RULES = (
    backlog_growing,
    workers_missing,
    idle_but_slow,
    compute_saturated,
    batches_not_filling,
    many_refusals,
    cpu_bound_gpu_idle,
    memory_growing,
    shared_dependency,
)


def gpu_status(workers: list[dict]) -> str:
    """Why the online children give no GPU figures, each reason with how many children gave it."""
    if not workers:
        return "no online child alive"
    reasons: dict[str, int] = {}
    for w in workers:
        reason = w.get("gpu") or "no `gpu` field (a worker from before GPU reporting)"
        reasons[reason] = reasons.get(reason, 0) + 1
    return "; ".join(f"{n} online child(ren): {reason}" for reason, n in sorted(reasons.items()))


def fill_online(s: Snapshot, seconds: list[dict[str, float]], workers: list[dict[str, Any]]) -> None:
    """The online figures from the sampled gauges and the children's heartbeats (no Redis: testable alone)."""
    s.online_backlog = [
        b["gauge|online|waiting"] + b.get("gauge|online|in_flight", 0.0) for b in seconds if "gauge|online|waiting" in b
    ]
    latest = next((b for b in reversed(seconds) if "gauge|online|in_flight" in b), {})
    s.online_in_flight = latest.get("gauge|online|in_flight", 0.0)
    s.online_workers_now = len(workers)
    s.online_workers_series = [b["gauge|workers|online"] for b in seconds if "gauge|workers|online" in b]
    s.online_workers_min = int(min(s.online_workers_series + [len(workers)]))
    s.worker_cpu_pct = sum(x.get("cpu_pct", 0.0) for x in workers) / len(workers) if workers else 0.0
    gpu = [x["gpu_util_pct"] for x in workers if x.get("gpu_util_pct") is not None]
    s.gpu_util_pct = sum(gpu) / len(gpu) if gpu else None
    if not gpu:
        s.gpu_status = gpu_status(workers)


def snapshot_source(client, s: Snapshot, seconds: list[dict[str, float]], now: float) -> None:
    """Adds to the snapshot what only the online path knows: heartbeats, busy time, the memory trend."""
    workers = [
        w
        for w in alive_workers(client.hgetall(WORKERS_KEY), settings.WORKER_HEARTBEAT_S, now)
        if w["queue"] == "online"
    ]
    fill_online(s, seconds, workers)
    pipe = client.pipeline(transaction=False)
    for model in {m for x in workers for m in x["models"]}:
        for offset in range(s.window_s):
            pipe.hget(rate_key(model, int(now) - offset), "busy_s")
    busy_s = sum(float(v) for v in pipe.execute() if v)
    s.busy_fraction = busy_s / (s.window_s * len(workers)) if workers else None
    # Trend: the first and last minutes of the longer span, for memory and median latency.
    trend = metrics.read_seconds(client, TREND_S, now, fields=["gauge|rss_mb|online"])
    rss = [b["gauge|rss_mb|online"] for b in trend if b]
    if len(rss) >= 2 and len(trend) >= TREND_S // 2:
        s.rss_mb_start, s.rss_mb_end = rss[0], rss[-1]
        s.p50_start_s = metrics.window(client, 60, now - TREND_S + 60).percentile_s("total", 50)
        s.p50_end_s = s.p50_s
