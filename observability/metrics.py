"""Metrics shared by every process (web, worker children), kept in Redis.

Why Redis and not process-local counters or prometheus_client's multiprocess mode: the processes
that see a request (uvicorn web, the worker's main process, its children) are separate and restart
independently, the dashboard needs short-term history (percentiles over the last 1 and 5 minutes,
15 minutes of charts), and Redis is already the one thing they all share. Two shapes:

- one hash per second (`metrics:s:<epoch second>`, expires after HISTORY_S) with counters and
  histogram buckets, for windows and charts;
- one lifetime hash (`metrics:total`) with the same counters, from which /metrics renders
  Prometheus counters and cumulative histograms.

Field names are `kind|model|name` so one hash per second holds every model; the key names are in
observability/keys.py.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from observability.keys import TOTAL_KEY, second_key

HISTORY_S = 20 * 60
# The timing stages of an online request, in the order they happen: the one list (Server-Timing,
# the slow-request log, the latency histograms and the tests all read it).
STAGES = ("admission", "queue_wait", "batch_wait", "pass_wait", "inference", "postprocess", "total")
# Status classes of online answers: what the dashboard charts and /metrics labels (`status`).
STATUS_CLASSES = ("2xx", "4xx", "429", "503", "504", "5xx")
# Upper bounds in seconds, fitted to this range: a few ms of overhead up to multi-second overload.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 1.5, 2.5, 4.0, 7.0, 12.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Upper bounds of the score histogram per model version (issue 21, canaries): 0.1 wide over 0..1, where a
# softmax probability (text-classification, span QA) and an in-domain cosine similarity (router, sentence QA:
# about 0.3 to 0.7) fall, with the cosine's negative half in the first bucket (<= 0): rare, and it says only
# "far from everything". No negative bound, so /metrics keeps the histogram's _sum and _count (prometheus_client
# drops them for negative buckets). Above 1.0 (a handler's own score) lands in the last bucket (+Inf).
SCORE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def latency_bucket(seconds: float) -> int:
    """Index of the first bucket whose upper bound holds `seconds`; len(LATENCY_BUCKETS_S) means +Inf."""
    return bisect.bisect_left(LATENCY_BUCKETS_S, seconds)


def size_bucket(size: int) -> int:
    return bisect.bisect_left(BATCH_SIZE_BUCKETS, size)


def score_bucket(score: float) -> int:
    """Index of the first SCORE_BUCKETS bound at or above `score`; len(SCORE_BUCKETS) means +Inf."""
    return bisect.bisect_left(SCORE_BUCKETS, score)


def is_error(outcome: str) -> bool:
    """Whether an outcome label is an error of the answer (anything but a 2xx)."""
    return status_class(outcome) != "2xx"


def status_class(outcome: str) -> str:
    """The status class of an outcome label (inference/web/observe.py: "ok", "400", "503_<reason>", "504"...).

    429, 503 and 504 stay apart from their class: they are the platform refusing or giving up (a
    client over its share, admission, a deadline), not a client's mistake or a bug.
    """
    if outcome == "ok" or outcome.startswith("2"):
        return "2xx"
    code = outcome.split("_", 1)[0]
    if code in ("429", "503", "504"):
        return code
    return "4xx" if code.startswith("4") else "5xx"


def request_fields(model: str, outcome: str, timing_ms: Mapping[str, float]) -> dict[str, float]:
    """Counter increments for one online request: its outcome, its status class (all models together,
    for the dashboard's charts) and each stage's histogram bucket."""
    fields: dict[str, float] = {f"req|{model}|{outcome}": 1, f"status|{status_class(outcome)}": 1}
    for stage in STAGES:
        value_ms = timing_ms.get(f"{stage}_ms")
        if value_ms is None:
            continue
        fields[f"lat|{model}|{stage}|{latency_bucket(value_ms / 1000)}"] = 1
        fields[f"latsum|{model}|{stage}"] = value_ms / 1000
    return fields


def version_fields(
    model: str, version: str, outcome: str, total_ms: float | None, scores: Iterable[float] = ()
) -> dict[str, float]:
    """Counter increments for one online request answered (or failed) by `version` of `model`: its
    outcome, its total latency's bucket, and each output's top-level score in the score histogram.

    `version` must already be bounded (inference/web/observe.py: only versions the models file names,
    a few per model); a request refused before a version was chosen has none and gets no fields here.
    """
    fields: dict[str, float] = {f"vreq|{model}|{version}|{outcome}": 1}
    if total_ms is not None:
        fields[f"vlat|{model}|{version}|{latency_bucket(total_ms / 1000)}"] = 1
        fields[f"vlatsum|{model}|{version}"] = total_ms / 1000
    counts = [0] * (len(SCORE_BUCKETS) + 1)
    total = 0.0
    for score in scores:  # counted per bucket first: one field name per bucket used, not one per score
        counts[bisect.bisect_left(SCORE_BUCKETS, score)] += 1
        total += score
    if any(counts):
        for index, count in enumerate(counts):
            if count:
                fields[f"vscore|{model}|{version}|{index}"] = count
        fields[f"vscoresum|{model}|{version}"] = float(total)
    return fields


def batch_fields(model: str, sizes: Iterable[int], max_batch_size: int, inference_s: float) -> dict[str, float]:
    """Counter increments for the forward passes of one dispatched online batch, and for the dispatch
    itself: how many texts the dispatcher merged into it (its passes may be fewer texts each, cut by
    length, max_padding_fraction; the diagnosis tells merging from cutting by the two)."""
    sizes = list(sizes)
    fields: dict[str, float] = {f"infer_s|{model}": inference_s}
    if sizes:
        fields[f"dispatches|{model}"] = 1
        fields[f"dispatch_texts|{model}"] = sum(sizes)
    for size in sizes:
        for key, value in (
            (f"bsize|{model}|{size_bucket(size)}", 1),
            (f"passes|{model}", 1),
            (f"pass_texts|{model}", size),
            (f"fill|{model}", size / max_batch_size),
        ):
            fields[key] = fields.get(key, 0) + value
    return fields


def write_pipeline(pipe, fields: Mapping[str, float], now: float | None = None) -> None:
    """Queue the increments on a Redis pipeline (sync or async): this second's hash and the lifetime hash."""
    key = second_key(int(time.time() if now is None else now))
    for name, value in fields.items():
        if isinstance(value, int):
            pipe.hincrby(key, name, value)
            pipe.hincrby(TOTAL_KEY, name, value)
        else:
            pipe.hincrbyfloat(key, name, value)
            pipe.hincrbyfloat(TOTAL_KEY, name, value)
    pipe.expire(key, HISTORY_S)


def record(client, fields: Mapping[str, float]) -> None:
    """Write from a sync process (worker children, the sampler)."""
    pipe = client.pipeline(transaction=False)
    write_pipeline(pipe, fields)
    pipe.execute()


class Accumulator:
    """Sums of increments per second, held in one process until they are written in one round trip.

    The web tier sees every request, refusals included; a pipeline of some 30 commands per request
    cost it and Redis more CPU than the refusal itself under overload. Summed here and flushed a
    few times a second, the Redis cost no longer grows with the request rate.
    """

    def __init__(self) -> None:
        self._by_second: dict[int, dict[str, float]] = {}

    def add(self, fields: Mapping[str, float], now: float | None = None) -> None:
        sums = self._by_second.setdefault(int(time.time() if now is None else now), {})
        for name, value in fields.items():
            sums[name] = sums.get(name, 0) + value

    def __bool__(self) -> bool:
        return bool(self._by_second)

    async def aflush(self, client) -> None:
        """Write what was summed (each second into its own hash) and start again.

        On a failure the sums are dropped, not retried: part of the pipeline may have been applied,
        and counting twice would be worse than a gap in the metrics.
        """
        if not self._by_second:
            return
        pending, self._by_second = self._by_second, {}
        pipe = client.pipeline(transaction=False)
        for second, sums in pending.items():
            write_pipeline(pipe, sums, now=second)
        await pipe.execute()


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


@dataclass
class Window:
    """Sums of the per-second counters over a span of seconds."""

    seconds: int
    counters: dict[str, float] = field(default_factory=dict)

    def get(self, name: str) -> float:
        return self.counters.get(name, 0.0)

    def matching(self, prefix: str) -> dict[str, float]:
        return {k: v for k, v in self.counters.items() if k.startswith(prefix)}

    def models(self) -> list[str]:
        return sorted(
            {k.split("|")[1] for k in self.counters if "|" in k and k.split("|")[0] in ("req", "passes", "orows")}
        )

    def by_status(self) -> dict[str, float]:
        """Requests per status class (from the outcomes, so it also reads windows older than `status|`)."""
        counts = dict.fromkeys(STATUS_CLASSES, 0.0)
        for name, value in self.matching("req|").items():
            counts[status_class(name.split("|")[2])] += value
        return counts

    def requests(self, model: str | None = None, outcome: str | None = None) -> float:
        total = 0.0
        for name, value in self.matching("req|").items():
            _, m, o = name.split("|")
            if (model is None or m == model) and (outcome is None or o == outcome or o.startswith(f"{outcome}_")):
                total += value
        return total

    def histogram(self, stage: str, model: str | None = None) -> list[float]:
        counts = [0.0] * (len(LATENCY_BUCKETS_S) + 1)
        for name, value in self.matching("lat|").items():
            _, m, s, bucket = name.split("|")
            if s == stage and (model is None or m == model):
                counts[int(bucket)] += value
        return counts

    def percentile_s(self, stage: str, pct: float, model: str | None = None) -> float | None:
        return histogram_percentile(self.histogram(stage, model), pct)

    def mean_batch_size(self, model: str | None = None) -> float | None:
        passes = sum(v for k, v in self.matching("passes|").items() if model is None or k.split("|")[1] == model)
        texts = sum(v for k, v in self.matching("pass_texts|").items() if model is None or k.split("|")[1] == model)
        return texts / passes if passes else None

    def mean_dispatch_size(self, model: str | None = None) -> float | None:
        """Texts per dispatched batch (None in a window recorded before dispatches were counted)."""
        sent = sum(v for k, v in self.matching("dispatches|").items() if model is None or k.split("|")[1] == model)
        texts = sum(v for k, v in self.matching("dispatch_texts|").items() if model is None or k.split("|")[1] == model)
        return texts / sent if sent else None

    def versions(self) -> list[VersionFigures]:
        return version_figures(self.counters)

    def mean_fill(self, model: str | None = None) -> float | None:
        passes = sum(v for k, v in self.matching("passes|").items() if model is None or k.split("|")[1] == model)
        fill = sum(v for k, v in self.matching("fill|").items() if model is None or k.split("|")[1] == model)
        return fill / passes if passes else None


@dataclass
class VersionFigures:
    """One (model, version)'s figures over a window: what a person compares before promoting a canary."""

    model: str
    version: str
    requests: float = 0.0
    errors: float = 0.0
    latency: list[float] = field(default_factory=lambda: [0.0] * (len(LATENCY_BUCKETS_S) + 1))
    scores: list[float] = field(default_factory=lambda: [0.0] * (len(SCORE_BUCKETS) + 1))
    score_sum: float = 0.0

    @property
    def error_pct(self) -> float | None:
        return 100 * self.errors / self.requests if self.requests else None

    @property
    def scored(self) -> float:
        return sum(self.scores)

    @property
    def mean_score(self) -> float | None:
        return self.score_sum / self.scored if self.scored else None

    def percentile_s(self, pct: float) -> float | None:
        return histogram_percentile(self.latency, pct)


def version_figures(counters: Mapping[str, float]) -> list[VersionFigures]:
    """Each (model, version) with figures in `counters` (a window's sums, or the lifetime totals), sorted."""
    found: dict[tuple[str, str], VersionFigures] = {}

    def of(model: str, version: str) -> VersionFigures:
        figures = found.get((model, version))
        if figures is None:
            figures = found[(model, version)] = VersionFigures(model, version)
        return figures

    for name, value in counters.items():
        kind, _, rest = name.partition("|")
        if kind not in ("vreq", "vlat", "vlatsum", "vscore", "vscoresum"):
            continue
        parts = rest.split("|")
        figures = of(parts[0], parts[1])
        if kind == "vreq":
            figures.requests += value
            if is_error(parts[2]):
                figures.errors += value
        elif kind == "vlat":
            figures.latency[int(parts[2])] += value
        elif kind == "vscore":
            figures.scores[int(parts[2])] += value
        elif kind == "vscoresum":
            figures.score_sum += value
    return [found[key] for key in sorted(found)]


def histogram_percentile(counts: list[float], pct: float) -> float | None:
    """The pct-th percentile in seconds, interpolated inside its bucket (like Prometheus' histogram_quantile)."""
    total = sum(counts)
    if total == 0:
        return None
    rank = pct / 100 * total
    seen = 0.0
    for index, count in enumerate(counts):
        if count and seen + count >= rank:
            lower = LATENCY_BUCKETS_S[index - 1] if index > 0 else 0.0
            upper = LATENCY_BUCKETS_S[index] if index < len(LATENCY_BUCKETS_S) else LATENCY_BUCKETS_S[-1] * 2
            return lower + (upper - lower) * (rank - seen) / count
        seen += count
    return LATENCY_BUCKETS_S[-1]


def read_seconds(
    client, seconds: int, now: float | None = None, fields: list[str] | None = None
) -> list[dict[str, float]]:
    """The per-second hashes of the last `seconds` seconds, oldest first (whole hashes, or only `fields`)."""
    end = int(time.time() if now is None else now)
    pipe = client.pipeline(transaction=False)
    for second in range(end - seconds + 1, end + 1):
        if fields:
            pipe.hmget(second_key(second), fields)
        else:
            pipe.hgetall(second_key(second))
    raw = pipe.execute()
    if fields:
        return [{f: float(v) for f, v in zip(fields, values, strict=True) if v is not None} for values in raw]
    return [{k: float(v) for k, v in h.items()} for h in raw]


def window(client, seconds: int, now: float | None = None) -> Window:
    totals: dict[str, float] = {}
    for bucket in read_seconds(client, seconds, now):
        for name, value in bucket.items():
            totals[name] = totals.get(name, 0.0) + value
    return Window(seconds=seconds, counters=totals)


def totals(client) -> dict[str, float]:
    return {k: float(v) for k, v in client.hgetall(TOTAL_KEY).items()}
