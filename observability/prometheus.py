"""GET /metrics: the shared Redis metrics as Prometheus metric families (prometheus_client collectors).

Scrape config: `- job_name: inference-platform; static_configs: [{targets: ["web:8000"]}];
authorization: {credentials: <METRICS_TOKEN>}` (the view answers 401 without it, unless METRICS_PUBLIC).
Autoscale on `platform_queue_depth{queue="online"}` or `platform_queue_predicted_wait_seconds` (KEDA
does, deploy/kubernetes), not on CPU: with batching and admission, CPU says little about the wait.

The counters live in Redis (every process adds to them), so a custom collector reads them at each
scrape instead of prometheus_client's in-process metrics; the metric names are those of the
hand-written text this replaced (docs, KEDA triggers and benchmarks use them).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.utils.crypto import constant_time_compare
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from observability import metrics, registry
from observability.keys import GAUGES_KEY
from platform_.redis import get_redis


def _cumulative(bounds: tuple[float, ...], counts: list[float]) -> list[tuple[str, float]]:
    buckets, running = [], 0.0
    for bound, count in zip([*(str(b) for b in bounds), "+Inf"], counts, strict=True):
        running += count
        buckets.append((bound, running))
    return buckets


class RedisMetricsCollector(Collector):
    """The lifetime counters (`metrics:total`) and the latest gauges (`metrics:gauges`) as metric families."""

    def __init__(self, totals: Mapping[str, float], gauges: Mapping[str, float]) -> None:
        self.totals, self.gauges = totals, gauges

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
        yield from self._latency()
        yield from self._batches()
        yield from self._versions()
        yield from self._simple_counters()
        yield from self._gauges()
        for families in registry.metric_families():  # each app's own series (e.g. jobs: offline work per user)
            yield from families(self.totals, self.gauges)

    def _requests(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "inference_requests_total",
            "Online predict requests by outcome (ok, 400, 503_<reason>, 504, ...) and status class "
            "(2xx, 4xx, 429, 503, 504, 5xx).",
            labels=["model", "outcome", "status"],
        )
        refusals = CounterMetricFamily(
            "inference_admission_refusals_total",
            "Online requests refused by admission, by reason.",
            labels=["model", "reason"],
        )
        for name, value in sorted(self.totals.items()):
            if name.startswith("req|"):
                _, model, outcome = name.split("|")
                requests.add_metric([model, outcome, metrics.status_class(outcome)], value)
                if outcome.startswith("503_"):
                    refusals.add_metric([model, outcome[4:]], value)
        yield requests
        yield refusals

    def _latency(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "inference_stage_latency_seconds", "Online request latency by stage.", labels=["model", "stage"]
        )
        counts: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0] * (len(metrics.LATENCY_BUCKETS_S) + 1))
        for name, value in self.totals.items():
            if name.startswith("lat|"):
                _, model, stage, index = name.split("|")
                counts[(model, stage)][int(index)] += value
        for (model, stage), by_bucket in sorted(counts.items()):
            family.add_metric(
                [model, stage],
                _cumulative(metrics.LATENCY_BUCKETS_S, by_bucket),
                self.totals.get(f"latsum|{model}|{stage}", 0.0),
            )
        yield family

    def _versions(self) -> Iterator[Metric]:
        """Per (model, version): requests by outcome, total latency and the score histogram (issue 21's
        canaries). The version label is bounded where it is written (inference/web/observe.py)."""
        requests = CounterMetricFamily(
            "inference_version_requests_total",
            "Online predict requests given to a model version, by outcome and status class; requests refused "
            "before a version was chosen are only in inference_requests_total.",
            labels=["model", "version", "outcome", "status"],
        )
        latency = HistogramMetricFamily(
            "inference_version_latency_seconds",
            "Total latency of online requests given to a model version.",
            labels=["model", "version"],
        )
        scores = HistogramMetricFamily(
            "inference_version_score",
            "Top-level score of each output of a model version (router, text-classification, question-answering).",
            labels=["model", "version"],
        )
        for name, value in sorted(self.totals.items()):
            if name.startswith("vreq|"):
                _, model, version, outcome = name.split("|")
                requests.add_metric([model, version, outcome, metrics.status_class(outcome)], value)
        for figures in metrics.version_figures(self.totals):
            labels = [figures.model, figures.version]
            if sum(figures.latency):
                latency.add_metric(
                    labels,
                    _cumulative(metrics.LATENCY_BUCKETS_S, figures.latency),
                    self.totals.get(f"vlatsum|{figures.model}|{figures.version}", 0.0),
                )
            if figures.scored:
                scores.add_metric(labels, _cumulative(metrics.SCORE_BUCKETS, figures.scores), figures.score_sum)
        yield from (requests, latency, scores)

    def _batches(self) -> Iterator[Metric]:
        sizes = HistogramMetricFamily(
            "inference_batch_size", "Texts per forward pass on the online workers.", labels=["model"]
        )
        fill = SummaryMetricFamily(
            "inference_batch_fill_ratio",
            "Texts / max_batch_size per forward pass: _sum over passes, _count passes.",
            labels=["model"],
        )
        counts: dict[str, list[float]] = defaultdict(lambda: [0.0] * (len(metrics.BATCH_SIZE_BUCKETS) + 1))
        for name, value in self.totals.items():
            if name.startswith("bsize|"):
                _, model, index = name.split("|")
                counts[model][int(index)] += value
        for model, by_bucket in sorted(counts.items()):
            sizes.add_metric(
                [model],
                _cumulative(metrics.BATCH_SIZE_BUCKETS, by_bucket),
                self.totals.get(f"pass_texts|{model}", 0.0),
            )
            fill.add_metric([model], self.totals.get(f"passes|{model}", 0.0), self.totals.get(f"fill|{model}", 0.0))
        yield sizes
        yield fill

    def _simple_counters(self) -> Iterator[Metric]:
        for metric, help_text, prefix in (
            ("inference_worker_inference_seconds_total", "Time online workers spent in forward passes.", "infer_s|"),
            ("inference_dispatches_total", "Batches the online dispatchers sent to a child.", "dispatches|"),
            (
                "inference_dispatch_texts_total",
                "Texts in those batches (/ dispatches: texts merged per dispatch; a dispatch runs as one or "
                "more passes cut by length).",
                "dispatch_texts|",
            ),
            ("offline_rows_total", "Rows processed by offline jobs.", "orows|"),
            ("offline_inference_seconds_total", "Time offline workers spent in forward passes.", "oinfer_s|"),
        ):
            family = CounterMetricFamily(metric, help_text, labels=["model"])
            for name, value in sorted(self.totals.items()):
                if name.startswith(prefix):
                    family.add_metric([name.split("|")[1]], value)
            yield family

    def _gauges(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "platform_queue_depth",
            "Work waiting and in flight per queue (online: requests; offline: chunks).",
            labels=["queue", "state"],
        )
        processes = GaugeMetricFamily(
            "platform_worker_processes", "Worker child processes alive per queue.", labels=["queue"]
        )
        memory = GaugeMetricFamily(
            "platform_worker_memory_bytes", "Resident memory of a queue's worker children.", labels=["queue"]
        )
        wait = GaugeMetricFamily(
            "platform_queue_predicted_wait_seconds",
            "Time an online queue's children need to clear its admitted work at their measured rate: scale on this.",
            labels=["queue"],
        )
        host = {
            "cpu_pct": GaugeMetricFamily("platform_host_cpu_percent", "CPU busy on the sampler's host, all cores."),
            "load1": GaugeMetricFamily("platform_host_load1", "1-minute load average of the sampler's host."),
            "cores": GaugeMetricFamily("platform_host_cores", "CPU cores of the sampler's host."),
        }
        for name, value in sorted(self.gauges.items()):
            parts = name.split("|")
            if len(parts) != 3:
                continue
            _, what, queue = parts
            if what == "workers":
                processes.add_metric([queue], value)
            elif what == "rss_mb":
                memory.add_metric([queue], round(value * 2**20))
            elif what == "host":
                if queue in host:
                    host[queue].add_metric([], value)
            elif queue == "predicted_wait_s":
                wait.add_metric([what], value)
            elif queue in ("waiting", "in_flight"):
                depth.add_metric([what, queue], value)
        yield from (depth, processes, memory, wait, *host.values())


def render(totals: Mapping[str, float], gauges: Mapping[str, float]) -> str:
    """The Prometheus text exposition (format 0.0.4) of these counters and gauges."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RedisMetricsCollector(totals, gauges))
    return generate_latest(registry).decode()


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
            "metrics need Authorization: Bearer <METRICS_TOKEN> (`make run` generates one into var/metrics_token),"
            " a staff session, or METRICS_PUBLIC=true\n",
            status=401,
            content_type="text/plain",
        )
        response["WWW-Authenticate"] = "Bearer"
        return response
    client = get_redis()
    gauges = {k: float(v) for k, v in client.hgetall(GAUGES_KEY).items()}
    return HttpResponse(render(metrics.totals(client), gauges), content_type=CONTENT_TYPE_LATEST)
