"""The staff dashboard: queue depth, latency, throughput, requests by status, batches, host, workers, jobs.

The page polls `data.json` every 2 s and draws its charts itself (no CDN: a user's network may not
reach one). Everything comes from the shared Redis metrics and gauges, plus what each app's registered
dashboard section adds (inference: queues, workers, the slow-request log; jobs: running jobs).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from observability import diagnosis, metrics, registry
from observability.keys import GAUGES_KEY
from platform_.redis import get_redis

logger = logging.getLogger(__name__)
SERIES_S = 15 * 60
SERIES_STEP_S = 5
NOW_S = 5  # "now" rates: the last few seconds, so a tile follows a load step within seconds
MINUTE_S = 60
# Findings that name the CPU as what everything waits for. Only these turn the host tiles red: a busy CPU
# under load is the CPU doing the work, expected and no jam by itself (issue 24: red CPU and load tiles
# beside a "no jam" verdict). Model compute saturated is the CPU's fault only where there is no GPU.
CPU_RULES = frozenset({"host_saturated", "cpu_bound_gpu_idle"})
CPU_RULES_WITHOUT_GPU = frozenset({"compute_saturated"})


def _series(client, now: float) -> dict[str, Any]:
    """Charts over the last 15 minutes in 5 s steps: answered/s, P50/P95/P99, requests/s by status, depths."""
    buckets = len(metrics.LATENCY_BUCKETS_S) + 1
    fields = [f"lat|{m}|total|{i}" for m in _models(client) for i in range(buckets)]
    fields += [f"status|{c}" for c in metrics.STATUS_CLASSES]
    fields += ["gauge|online|waiting", "gauge|online|in_flight", "gauge|offline|waiting", "gauge|offline|in_flight"]
    seconds = metrics.read_seconds(client, SERIES_S, now, fields=fields)
    out: dict[str, Any] = {k: [] for k in ("t", "qps", "p50_ms", "p95_ms", "p99_ms", "online_depth", "offline_depth")}
    out["status_per_s"] = {c: [] for c in metrics.STATUS_CLASSES}
    start = int(now) - SERIES_S + 1
    for offset in range(0, SERIES_S, SERIES_STEP_S):
        chunk = seconds[offset : offset + SERIES_STEP_S]
        counts = [0.0] * buckets
        by_status = dict.fromkeys(metrics.STATUS_CLASSES, 0.0)
        online: list[float] = []
        offline: list[float] = []
        for second in chunk:
            for k, v in second.items():
                if k.startswith("lat|"):
                    counts[int(k.rsplit("|", 1)[1])] += v
                elif k.startswith("status|"):
                    by_status[k.split("|", 1)[1]] += v
            if "gauge|online|waiting" in second:
                online.append(second["gauge|online|waiting"] + second.get("gauge|online|in_flight", 0.0))
            if "gauge|offline|waiting" in second:
                offline.append(second["gauge|offline|waiting"] + second.get("gauge|offline|in_flight", 0.0))
        out["t"].append(start + offset)
        out["qps"].append(round(by_status["2xx"] / SERIES_STEP_S, 2))
        for pct in (50, 95, 99):
            value = metrics.histogram_percentile(counts, pct)
            out[f"p{pct}_ms"].append(None if value is None else round(value * 1000, 1))
        for c in metrics.STATUS_CLASSES:
            out["status_per_s"][c].append(round(by_status[c] / SERIES_STEP_S, 2))
        out["online_depth"].append(max(online) if online else None)
        out["offline_depth"].append(max(offline) if offline else None)
    return out


def _models(client) -> list[str]:
    """Models with latency figures in the lifetime counters (the series reads their buckets)."""
    return sorted({k.split("|")[1] for k in client.hkeys(metrics.TOTAL_KEY) if k.startswith("lat|")})


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _per_s(window: metrics.Window) -> dict[str, float]:
    return {c: round(v / window.seconds, 2) for c, v in window.by_status().items()}


def _host(gauges: dict[str, float], cpu_findings: list[str]) -> dict[str, Any]:
    cores = gauges.get("gauge|host|cores")
    return {
        "cores": int(cores) if cores else None,
        "cpu_pct": gauges.get("gauge|host|cpu_pct"),
        "load1": gauges.get("gauge|host|load1"),
        "load5": gauges.get("gauge|host|load5"),
        # The verdict's findings that blame the CPU (their symptoms); empty: a busy CPU is no jam now.
        "cpu_findings": cpu_findings,
    }


def cpu_findings(findings: list[diagnosis.Finding], snapshot: diagnosis.Snapshot) -> list[str]:
    """The symptoms of the findings that name the CPU as the jam (CPU_RULES, and CPU_RULES_WITHOUT_GPU
    when no online child reports GPU figures, so that the model runs on the CPU)."""
    rules = CPU_RULES | (CPU_RULES_WITHOUT_GPU if snapshot.gpu_util_pct is None else frozenset())
    return [f.symptom for f in findings if f.rule in rules]


def version_roles(client) -> dict[str, dict[str, str]]:
    """{model: {version: role}} from every registered source (the deploying app's); a failing source
    leaves the versions unmarked rather than the dashboard blank."""
    roles: dict[str, dict[str, str]] = {}
    for source in registry.version_roles():
        try:
            for model, by_version in source(client).items():
                roles.setdefault(model, {}).update(by_version)
        except Exception:
            logger.exception("reading the versions' roles failed; the Versions table shows them unmarked")
    return roles


def version_rows(window: metrics.Window, roles: Mapping[str, Mapping[str, str]]) -> list[dict[str, Any]]:
    """The Versions table: each (model, version) with figures in the window, and beside them the versions
    the deployment names for that model even without traffic yet (a canary no caller reached); a model with
    no traffic is listed only while it has more than an active version (a canary, a promotion loading).
    Per row: requests, error %, P50/P99 of the total latency, mean score and the score histogram (counts per
    metrics.SCORE_BUCKETS bucket, the last one above 1.0)."""
    figures = {(f.model, f.version): f for f in window.versions()}
    busy = {model for model, _ in figures}
    for model, by_version in roles.items():
        if model in busy or set(by_version.values()) - {"active"}:
            for version in by_version:
                figures.setdefault((model, version), metrics.VersionFigures(model, version))
    rows = []
    for (model, version), f in sorted(figures.items()):
        rows.append(
            {
                "model": model,
                "version": version,
                "role": roles.get(model, {}).get(version),
                "requests": int(f.requests),
                "per_s": round(f.requests / window.seconds, 2),
                "errors": int(f.errors),
                "error_pct": None if f.error_pct is None else round(f.error_pct, 2),
                "p50_ms": _ms(f.percentile_s(50)),
                "p99_ms": _ms(f.percentile_s(99)),
                "scored": int(f.scored),
                "mean_score": None if f.mean_score is None else round(f.mean_score, 4),
                "score_histogram": [int(c) for c in f.scores],
            }
        )
    return rows


def dashboard_data(client=None, now: float | None = None) -> dict[str, Any]:
    client = client or get_redis()
    now = time.time() if now is None else now
    gauges = {k: float(v) for k, v in client.hgetall(GAUGES_KEY).items()}
    # Rates and charts end at the last complete second: the current one is still filling, and counted
    # whole it read a 5 s rate up to a fifth low and dipped every chart's last point.
    complete = now - 1
    snapshot = diagnosis.snapshot(client, window_s=MINUTE_S, now=complete)
    findings = diagnosis.diagnose(snapshot)
    recent = metrics.window(client, NOW_S, complete)
    minute = metrics.window(client, MINUTE_S, complete)
    data: dict[str, Any] = {
        "now": now,
        "queues": {
            q: {"waiting": gauges.get(f"gauge|{q}|waiting", 0.0), "in_flight": gauges.get(f"gauge|{q}|in_flight", 0.0)}
            for q in ("online", "offline")
        },
        "online_queues": [],
        "sampled_s_ago": round(now - gauges["sampled_at"], 1) if "sampled_at" in gauges else None,
        "heartbeat_s": settings.WORKER_HEARTBEAT_S,
        "online": {
            # Successful answers per second over the last minute (the old tile's figure, kept).
            "qps": round(snapshot.ok_per_s, 2),
            # Every answer, whatever its status, per second over the last 5 s and the last minute.
            "answered_per_s_5s": round(recent.requests() / NOW_S, 2),
            "answered_per_s": round(snapshot.requests_per_s, 2),
            "ok_per_s_5s": round(recent.requests(outcome="ok") / NOW_S, 2),
            "p50_ms": _ms(snapshot.p50_s),
            "p95_ms": _ms(snapshot.p95_s),
            "p99_ms": _ms(snapshot.p99_s),
            "refusals_per_s": {k: round(v, 2) for k, v in snapshot.refusals_per_s.items()},
            "timeouts_per_s": round(snapshot.timeouts_per_s, 2),
            "mean_batch_size": None if snapshot.mean_batch_size is None else round(snapshot.mean_batch_size, 2),
            "mean_fill_pct": None if snapshot.mean_fill is None else round(snapshot.mean_fill * 100, 1),
            "offline_rows_per_s": round(snapshot.offline_rows_per_s, 1),
        },
        "requests": {"now": _per_s(recent), "minute": _per_s(minute)},
        "host": _host(gauges, cpu_findings(findings, snapshot)),
        "workers": [],
        "jobs": [],
        "slow": [],
        "series": _series(client, complete),
        # Per model version over the last minute (issue 21: compare a canary with the active version).
        "versions": version_rows(minute, version_roles(client)),
        "score_buckets": list(metrics.SCORE_BUCKETS),
        "verdict": {
            "text": diagnosis.report(snapshot),
            "findings": [f.__dict__ for f in findings],
        },
    }
    for section in registry.dashboard_sections():
        data.update(section(client, now))
    return data


def staff_only(view):
    """Anonymous people go to the product's login page; signed-in people who are not staff get the styled
    403 page (issue 24: they landed on the admin's login, which said they "cannot use the admin")."""

    @functools.wraps(view)
    def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not (request.user.is_active and request.user.is_staff):
            raise PermissionDenied("the dashboard is for the platform's staff")
        return view(request, *args, **kwargs)

    return wrapped


@staff_only
def dashboard(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard.html", {"flower_url": settings.FLOWER_URL})


@staff_only
def dashboard_json(request: HttpRequest) -> JsonResponse:
    data = dashboard_data()
    for hide in registry.dashboard_filters():  # what this staff member may not see of the tenants
        data = hide(data, request.user)
    return JsonResponse(data)
