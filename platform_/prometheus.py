"""GET /metrics: the shared Redis metrics in Prometheus text format.

Scrape config: `- job_name: inference-platform; static_configs: [{targets: ["web:8000"]}];
authorization: {credentials: <METRICS_TOKEN>}` (the view answers 401 without it, unless METRICS_PUBLIC). Autoscale
on `platform_queue_depth{queue="online"}` (or admission refusals), not on CPU: the article's point.
"""

from __future__ import annotations

from collections import defaultdict

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.utils.crypto import constant_time_compare

from platform_ import metrics
from platform_.redis import get_redis


def _labels(**labels: str) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return "{" + inner + "}" if inner else ""


def render(totals: dict[str, float], gauges: dict[str, float]) -> str:
    out: list[str] = []

    def family(name: str, kind: str, help_text: str) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")

    family(
        "inference_requests_total", "counter", "Online predict requests by outcome (ok, 400, 503_<reason>, 504, ...)."
    )
    family("inference_admission_refusals_total", "counter", "Online requests refused by admission, by reason.")
    refusals = []
    for name, value in sorted(totals.items()):
        if name.startswith("req|"):
            _, model, outcome = name.split("|")
            out.append(f"inference_requests_total{_labels(model=model, outcome=outcome)} {value:g}")
            if outcome.startswith("503_"):
                refusals.append(
                    f"inference_admission_refusals_total{_labels(model=model, reason=outcome[4:])} {value:g}"
                )
    out.extend(refusals)

    family("inference_stage_latency_seconds", "histogram", "Online request latency by stage.")
    buckets: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0] * (len(metrics.LATENCY_BUCKETS_S) + 1))
    for name, value in totals.items():
        if name.startswith("lat|"):
            _, model, stage, index = name.split("|")
            buckets[(model, stage)][int(index)] += value
    for (model, stage), counts in sorted(buckets.items()):
        running = 0.0
        for bound, count in zip([*metrics.LATENCY_BUCKETS_S, "+Inf"], counts, strict=True):
            running += count
            out.append(
                f"inference_stage_latency_seconds_bucket{_labels(model=model, stage=stage, le=str(bound))} {running:g}"
            )
        out.append(
            f"inference_stage_latency_seconds_sum{_labels(model=model, stage=stage)} {totals.get(f'latsum|{model}|{stage}', 0):g}"
        )
        out.append(f"inference_stage_latency_seconds_count{_labels(model=model, stage=stage)} {running:g}")

    family("inference_batch_size", "histogram", "Texts per forward pass on the online workers.")
    sizes: dict[str, list[float]] = defaultdict(lambda: [0.0] * (len(metrics.BATCH_SIZE_BUCKETS) + 1))
    for name, value in totals.items():
        if name.startswith("bsize|"):
            _, model, index = name.split("|")
            sizes[model][int(index)] += value
    for model, counts in sorted(sizes.items()):
        running = 0.0
        for bound, count in zip([*metrics.BATCH_SIZE_BUCKETS, "+Inf"], counts, strict=True):
            running += count
            out.append(f"inference_batch_size_bucket{_labels(model=model, le=str(bound))} {running:g}")
        out.append(f"inference_batch_size_sum{_labels(model=model)} {totals.get(f'pass_texts|{model}', 0):g}")
        out.append(f"inference_batch_size_count{_labels(model=model)} {running:g}")

    simple = [
        (
            "inference_batch_fill_ratio_sum",
            "counter",
            "Sum over passes of texts / max_batch_size (divide by the batch size count).",
            "fill|",
        ),
        (
            "inference_worker_inference_seconds_total",
            "counter",
            "Time online workers spent in forward passes.",
            "infer_s|",
        ),
        ("offline_rows_total", "counter", "Rows processed by offline jobs.", "orows|"),
        ("offline_inference_seconds_total", "counter", "Time offline workers spent in forward passes.", "oinfer_s|"),
    ]
    for metric, kind, help_text, prefix in simple:
        family(metric, kind, help_text)
        for name, value in sorted(totals.items()):
            if name.startswith(prefix):
                out.append(f"{metric}{_labels(model=name.split('|')[1])} {value:g}")

    family("platform_queue_depth", "gauge", "Work waiting and in flight per queue (online: requests; offline: chunks).")
    family("platform_worker_processes", "gauge", "Worker child processes alive per queue.")
    family("platform_worker_memory_bytes", "gauge", "Resident memory of a queue's worker children.")
    family(
        "platform_queue_predicted_wait_seconds",
        "gauge",
        "Time an online queue's children need to clear its admitted work at their measured rate: scale on this.",
    )
    for name, value in sorted(gauges.items()):
        parts = name.split("|")
        if len(parts) != 3:
            continue
        _, what, queue = parts
        if what == "workers":
            out.append(f"platform_worker_processes{_labels(queue=queue)} {value:g}")
        elif what == "rss_mb":
            out.append(f"platform_worker_memory_bytes{_labels(queue=queue)} {value * 2**20:.0f}")
        elif queue == "predicted_wait_s":
            out.append(f"platform_queue_predicted_wait_seconds{_labels(queue=what)} {value:g}")
        elif queue in ("waiting", "in_flight"):
            out.append(f"platform_queue_depth{_labels(queue=what, state=queue)} {value:g}")
    return "\n".join(out) + "\n"


def _may_scrape(request: HttpRequest) -> bool:
    """Closed by default: queue depths and model names tell an outsider how to hurt the service."""
    if settings.METRICS_PUBLIC:
        return True
    if constant_time_compare(request.headers.get("Authorization", ""), f"Bearer {settings.METRICS_TOKEN}"):
        return True
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_active and user.is_staff)


def metrics_view(request: HttpRequest) -> HttpResponse:
    if not _may_scrape(request):
        response = HttpResponse(
            "metrics need Authorization: Bearer <METRICS_TOKEN> (generated into var/metrics_token when not set),"
            " a staff session, or METRICS_PUBLIC=true\n",
            status=401,
            content_type="text/plain",
        )
        response["WWW-Authenticate"] = "Bearer"
        return response
    client = get_redis()
    gauges = {k: float(v) for k, v in client.hgetall(metrics.GAUGES_KEY).items()}
    body = render(metrics.totals(client), gauges)
    return HttpResponse(body, content_type="text/plain; version=0.0.4; charset=utf-8")
