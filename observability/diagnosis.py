"""Names the jam: the troubleshooting table as small rules over live figures.

`snapshot()` reads the figures (the shared metrics, the sampled gauges, and what each app's snapshot
source adds: heartbeats, drain-rate buckets); `diagnose()` runs every registered rule on them. Each rule
is a pure function of a `Snapshot`, so it is tested on figures made for it and on recorded windows.
`python manage.py diagnose` and the dashboard print the same verdict.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from observability import metrics, registry


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
    # Time in the broker and in the worker's buffer before the dispatch's first pass (stages queue_wait,
    # batch_wait), then behind the dispatch's earlier passes (pass_wait: batching at work, not waiting).
    queue_wait_p50_s: float | None = None
    batch_wait_p50_s: float | None = None
    pass_wait_p50_s: float | None = None
    mean_batch_size: float | None = None  # texts per forward pass
    mean_dispatch_size: float | None = None  # texts per dispatched batch (one or more passes)
    mean_fill: float | None = None
    # Answered (status 200) requests, one count per second of the window, oldest first.
    ok_series: list[float] = field(default_factory=list)
    # Online requests admitted (waiting in the broker plus buffered or running in a worker), one
    # sample per second, oldest first. The broker list alone stays near empty: workers prefetch.
    online_backlog: list[float] = field(default_factory=list)
    online_in_flight: float = 0.0
    online_workers_now: int = 0
    online_workers_min: int = 0  # fewest alive during the window
    # Online children alive, one sample per second (the sampler's gauge), oldest first.
    online_workers_series: list[float] = field(default_factory=list)
    busy_fraction: float | None = None  # share of child-time spent running batches
    worker_cpu_pct: float = 0.0  # per online child, on average
    gpu_util_pct: float | None = None
    # Why there is no GPU figure, from the online children's heartbeats ("cpu device", "none (no NVIDIA driver ...)").
    gpu_status: str | None = None
    rss_mb_start: float | None = None  # online children's total memory, a long window apart
    rss_mb_end: float | None = None
    p50_start_s: float | None = None
    p50_end_s: float | None = None
    # The host the sampler runs on: CPU busy (all cores, percent), 1-minute load average, cores.
    host_cpu_pct: float | None = None
    host_load1: float | None = None
    host_cores: int | None = None
    # The latest sample of every gauge in the window (`gauge|<what>|<queue>`), for apps' own rules.
    gauges: dict[str, float] = field(default_factory=dict)


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


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def _verdicts(s: Snapshot, rules: Iterable | None) -> list[Finding | Unevaluated]:
    out = []
    for rule in registry.rules() if rules is None else rules:
        verdict = rule(s)
        if verdict is not None:
            out.append(verdict)
    return out


def diagnose(s: Snapshot, rules: Iterable | None = None) -> list[Finding]:
    """Every rule that holds now (the registered rules, in order, unless `rules` is given); empty means no jam."""
    return [v for v in _verdicts(s, rules) if isinstance(v, Finding)]


def not_evaluated(s: Snapshot, rules: Iterable | None = None) -> list[Unevaluated]:
    """Rules that could not be evaluated on these figures (today: the GPU rule on a host without GPU figures)."""
    return [v for v in _verdicts(s, rules) if isinstance(v, Unevaluated)]


def summary(s: Snapshot) -> str:
    host = ""
    if s.host_cpu_pct is not None:
        host = f", host CPU {s.host_cpu_pct:.0f}% load {s.host_load1 or 0:.1f} on {s.host_cores or '?'} cores"
    return (
        f"last {s.window_s} s: {s.requests_per_s:.1f} requests/s ({s.ok_per_s:.1f} ok), P50 {ms(s.p50_s)}, "
        f"P99 {ms(s.p99_s)}, mean pass {s.mean_batch_size or 0:.2f} texts"
        f"{'' if s.mean_dispatch_size is None else f' (dispatch {s.mean_dispatch_size:.2f})'}, online backlog "
        f"{(s.online_backlog or [0])[-1]:.0f} ({s.online_in_flight:.0f} in a worker), "
        f"{s.online_workers_now} online children, busy {(s.busy_fraction or 0) * 100:.0f}%{host}"
    )


def report(s: Snapshot, rules: Iterable | None = None) -> str:
    """The verdict as text: each finding with evidence and action, or 'no jam' with the figures."""
    rules = registry.rules() if rules is None else list(rules)
    findings = diagnose(s, rules)
    lines = [f"{len(findings)} finding(s); {summary(s)}" if findings else f"no jam: {summary(s)}"]
    for f in findings:
        lines += [f"- {f.symptom} [{f.rule}]", f"    evidence: {f.evidence}", f"    action:   {f.action}"]
    lines += [f"not evaluated: {u.symptom} [{u.rule}]: {u.why}" for u in not_evaluated(s, rules)]
    return "\n".join(lines)


def from_seconds(seconds: list[dict[str, float]], window_s: int) -> Snapshot:
    """The figures that the shared metrics alone give (requests, latency, batches, host gauges).

    `seconds` are the per-second hashes of the window, oldest first, as `metrics.read_seconds` returns
    them (a recorded window replays through here too).
    """
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
    s.queue_wait_p50_s = w.percentile_s("queue_wait", 50)
    s.batch_wait_p50_s = w.percentile_s("batch_wait", 50)
    s.pass_wait_p50_s = w.percentile_s("pass_wait", 50)
    s.mean_batch_size, s.mean_fill = w.mean_batch_size(), w.mean_fill()
    s.mean_dispatch_size = w.mean_dispatch_size()
    s.ok_series = [sum(v for k, v in b.items() if k.startswith("req|") and k.endswith("|ok")) for b in seconds]
    for bucket in seconds:
        s.gauges.update({k: v for k, v in bucket.items() if k.startswith("gauge|")})
    s.host_cpu_pct = s.gauges.get("gauge|host|cpu_pct")
    s.host_load1 = s.gauges.get("gauge|host|load1")
    cores = s.gauges.get("gauge|host|cores")
    s.host_cores = int(cores) if cores else None
    return s


def snapshot(client, window_s: int = 60, now: float | None = None) -> Snapshot:
    """Read the figures from Redis: the metrics of the window, then what each app's source adds."""
    now = time.time() if now is None else now
    seconds = metrics.read_seconds(client, window_s, now)
    s = from_seconds(seconds, window_s)
    for source in registry.snapshot_sources():
        source(client, s, seconds, now)
    return s
