"""Per-version figures (issue 21, item 5): what the web tier counts for each model version, the bounded
version label, the Versions rows of data.json, /metrics, and the dashboard's Versions table as the page's
own script writes it (run by Node on a stand-in document when no browser is installed)."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference.web import observe as observing
from observability import metrics, registry
from observability.dashboard import dashboard_data, version_rows
from observability.metrics import SCORE_BUCKETS, score_bucket, version_fields, write_pipeline
from observability.prometheus import render
from tests.conftest import ROOT

DB = 7  # this module's own Redis database (the `client` fixture, tests/observability/conftest.py)


# ---- the score histogram's buckets ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("score", "upper"),
    [(-1.0, 0.0), (-0.2, 0.0), (0.0, 0.0), (0.05, 0.1), (0.1, 0.1), (0.42, 0.5), (0.99, 1.0), (1.0, 1.0)],
)
def test_a_score_lands_in_the_bucket_whose_upper_bound_holds_it(score, upper):
    assert SCORE_BUCKETS[score_bucket(score)] == upper


def test_scores_above_one_go_to_the_last_bucket_and_the_buckets_cover_cosine_and_probabilities():
    assert score_bucket(1.5) == len(SCORE_BUCKETS)  # +Inf
    # A cosine's negative half in the first bucket, then 0.1 wide from 0 to 1.
    assert list(SCORE_BUCKETS) == pytest.approx([round(0.1 * i, 1) for i in range(11)])


def test_version_fields_count_the_outcome_the_latency_and_each_score():
    fields = version_fields("router", "2", "ok", 30.0, [0.42, 0.45, 0.91])
    assert fields["vreq|router|2|ok"] == 1
    assert fields[f"vlat|router|2|{metrics.latency_bucket(0.030)}"] == 1
    assert fields["vlatsum|router|2"] == pytest.approx(0.030)
    assert fields[f"vscore|router|2|{score_bucket(0.42)}"] == 2 and fields[f"vscore|router|2|{score_bucket(0.91)}"] == 1
    assert fields["vscoresum|router|2"] == pytest.approx(1.78)
    # No score (embeddings), no latency (never happens on the path, but nothing breaks): no such fields.
    bare = version_fields("embedding", "1", "504", None)
    assert bare == {"vreq|embedding|1|504": 1}


# ---- which version a request is counted under -------------------------------------------------------------


def test_no_version_means_no_per_version_figures():
    seen: set[str] = set()
    assert observing.version_label(None, None, seen) is None
    assert observing.version_label("", frozenset({"1"}), seen) is None
    assert seen == set()


def test_only_the_models_files_versions_get_their_own_series():
    known, seen = frozenset({"1", "2"}), set()
    assert observing.version_label("2", known, seen) == "2"
    assert observing.version_label("3", known, seen) == observing.OTHER_VERSION
    assert seen == {"2"}


@pytest.mark.parametrize("hostile", ["a|b", "x" * 65, "../etc", "2\n", "v 2", 3, ["1"], {"v": 1}, "other"])
def test_a_hostile_or_buggy_version_is_counted_as_other(hostile):
    assert observing.version_label(hostile, None, set()) == observing.OTHER_VERSION


def test_without_declared_versions_a_model_gets_at_most_the_cap():
    seen: set[str] = set()
    labels = [observing.version_label(f"v{i}", None, seen, cap=3) for i in range(100)]
    assert labels[:3] == ["v0", "v1", "v2"] and set(labels[3:]) == {observing.OTHER_VERSION}
    assert observing.version_label("v1", None, seen, cap=3) == "v1", "a version seen before keeps its label"
    assert len(seen) == 3


def test_scores_are_the_outputs_top_level_numbers():
    outputs = [
        {"label": "billing", "score": 0.66},
        {"answer": "x", "score": 1},
        {"embedding": [0.1, 0.2]},
        {"entities": [{"score": 0.9}]},  # per entity: not a top-level score
        {"score": True},
        {"score": math.nan},
        {"score": "0.5"},
        "not a dict",
    ]
    assert observing.output_scores(outputs) == [0.66, 1.0]
    assert observing.output_scores(None) == []


def test_observe_attributes_errors_to_the_version_and_refusals_to_the_model_only(monkeypatch, settings):
    settings.SLOW_REQUEST_MS = 1e9  # no slow-log row (and no database) here
    monkeypatch.setattr(observing, "known_versions", lambda model: frozenset({"1", "2"}))
    monkeypatch.setattr(observing, "_versions_seen", {})

    async def requests() -> dict[str, float]:
        outputs = [{"label": "billing", "score": 0.62}]
        common = {"model": "router", "request_id": "r", "texts": ["t"]}
        observing.observe(status=200, code=None, timing={"total_ms": 20.0}, version="1", outputs=outputs, **common)
        observing.observe(status=200, code=None, timing={"total_ms": 80.0}, version="2", outputs=outputs, **common)
        # No answer, so no model_version: the version it was admitted to (online.predict notes it).
        assert observing.version_admitted() is None
        observing.admitted_to_version("2")
        observing.observe(
            status=504,
            code="deadline_exceeded",
            timing={"total_ms": 9000.0},
            version=observing.version_admitted(),
            **common,
        )
        observing.observe(
            status=502, code="worker_failed", timing={"total_ms": 40.0}, version="2", outputs=outputs, **common
        )
        observing.observe(status=503, code="backlog_full", timing={"total_ms": 1.0}, **common)  # before a version
        # A version picked, then refused by admission: the request never reached it.
        observing.observe(status=429, code="rate_limited", timing={"total_ms": 1.0}, version="1", **common)
        observing.observe(status=200, code=None, timing={"total_ms": 20.0}, version="9|x", outputs=outputs, **common)
        accumulator = observing._accumulator()
        sums: dict[str, float] = {}
        for by_second in accumulator._by_second.values():
            for name, value in by_second.items():
                sums[name] = sums.get(name, 0) + value
        accumulator._by_second.clear()  # the flusher must not write them to the suite's Redis
        return sums

    sums = asyncio.run(requests())
    assert sums["req|router|ok"] == 3 and sums["req|router|503_backlog_full"] == 1
    assert sums["vreq|router|1|ok"] == 1 and sums["vreq|router|2|ok"] == 1
    assert sums["vreq|router|2|504"] == 1 and sums["vreq|router|2|502"] == 1
    assert sums["vreq|router|other|ok"] == 1, "an unknown version is counted, under `other`"
    assert sums["req|router|429"] == 1
    assert not any(k.startswith("vreq|") and ("503" in k or "429" in k) for k in sums), "a refusal has no version"
    # Scores of answered requests only: the 502's outputs were never answered.
    assert sums["vscoresum|router|2"] == pytest.approx(0.62)
    figures = {(f.model, f.version): f for f in metrics.version_figures(sums)}
    assert figures[("router", "2")].requests == 3 and figures[("router", "2")].errors == 2
    assert figures[("router", "1")].error_pct == 0.0


# ---- reading them back: rows, /metrics --------------------------------------------------------------------


def counters_of(requests: list[tuple[str, str, str, float, list[float]]]) -> dict[str, float]:
    sums: dict[str, float] = {}
    for model, version, outcome, total_ms, scores in requests:
        for name, value in version_fields(model, version, outcome, total_ms, scores).items():
            sums[name] = sums.get(name, 0) + value
    return sums


# A canary slower and less sure than the active version: 90 answers of 30 ms scoring 0.6 against 10 of
# 300 ms scoring 0.35, one of which failed.
CANARY_TRAFFIC = [("router", "1", "ok", 30.0, [0.6])] * 90 + [("router", "2", "ok", 300.0, [0.35])] * 9
CANARY_TRAFFIC += [("router", "2", "502", 40.0, []), ("embedding", "1", "ok", 10.0, [])]


def test_version_rows_compare_a_canary_with_the_active_version():
    window = metrics.Window(seconds=60, counters=counters_of(CANARY_TRAFFIC))
    rows = {(r["model"], r["version"]): r for r in version_rows(window, {"router": {"1": "active", "2": "canary"}})}
    active, canary, embedding = rows[("router", "1")], rows[("router", "2")], rows[("embedding", "1")]
    assert active["role"] == "active" and canary["role"] == "canary" and embedding["role"] is None
    assert (active["requests"], active["errors"], active["error_pct"]) == (90, 0, 0.0)
    assert (canary["requests"], canary["errors"], canary["error_pct"]) == (10, 1, 10.0)
    assert 25 <= active["p50_ms"] <= 35 and 250 <= canary["p50_ms"] <= 400 and canary["p99_ms"] >= canary["p50_ms"]
    assert active["mean_score"] == pytest.approx(0.6) and canary["mean_score"] == pytest.approx(0.35)
    assert active["score_histogram"][score_bucket(0.6)] == 90 and sum(active["score_histogram"]) == 90
    assert canary["scored"] == 9 and embedding["scored"] == 0 and embedding["mean_score"] is None
    assert active["per_s"] == 1.5


def test_a_version_the_deployment_names_is_listed_before_its_first_request():
    roles = {"router": {"1": "active", "3": "canary"}, "embedding": {"1": "active"}, "qa": {"1": "active"}}
    window = metrics.Window(seconds=60, counters=counters_of([("qa", "1", "ok", 20.0, [0.8])]))
    rows = [
        (r["model"], r["version"], r["role"], r["requests"], r["error_pct"], r["p50_ms"])
        for r in version_rows(window, roles)
    ]
    # A model without traffic and without a canary (embedding) is not listed: no row of zeros per model.
    assert rows == [
        ("qa", "1", "active", 1, 0.0, rows[0][5]),
        ("router", "1", "active", 0, None, None),
        ("router", "3", "canary", 0, None, None),
    ]


def test_metrics_exposes_each_versions_requests_latency_and_scores():
    text = render(counters_of(CANARY_TRAFFIC), {})
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("inference_version_requests_total", model="router", version="2", outcome="502", status="5xx") == 1
    assert value("inference_version_requests_total", model="router", version="1", outcome="ok", status="2xx") == 90
    assert value("inference_version_latency_seconds_count", model="router", version="2") == 10
    assert value("inference_version_latency_seconds_bucket", model="router", version="1", le="0.035") == 90
    assert value("inference_version_score_bucket", model="router", version="2", le="0.4") == 9
    assert value("inference_version_score_bucket", model="router", version="2", le="0.3") == 0
    assert value("inference_version_score_sum", model="router", version="1") == pytest.approx(54.0)
    assert not any(name == "inference_version_score_count" and dict(labels)["model"] == "embedding"
                   for name, labels in samples), "no score series for a model without scores"  # fmt: skip


@pytest.mark.django_db
def test_dashboard_data_has_the_versions_of_the_last_minute(client, monkeypatch):
    now = int(time.time())
    pipe = client.pipeline(transaction=False)
    write_pipeline(pipe, counters_of(CANARY_TRAFFIC), now=now - 10)
    write_pipeline(pipe, counters_of([("router", "old", "ok", 30.0, [0.5])]), now=now - 120)  # before the minute
    pipe.execute()
    monkeypatch.setattr(registry, "_version_roles", [lambda c: {"router": {"1": "active", "2": "canary"}}])
    data = dashboard_data(client, now=now + 0.5)
    rows = {(r["model"], r["version"]): r for r in data["versions"]}
    assert set(rows) == {("router", "1"), ("router", "2"), ("embedding", "1")}
    assert rows[("router", "2")]["role"] == "canary" and rows[("router", "2")]["error_pct"] == 10.0
    assert data["score_buckets"] == list(SCORE_BUCKETS)


def test_inference_marks_the_deployments_versions(client):
    from inference.core import versions
    from inference.web.monitoring import version_roles

    assert version_roles(client)["router"] == {"1": "active"}, "no deployment row: the file's entry version"
    deployment = versions.Deployment(model="router", active="1", canary="2", canary_percent=10, canary_ready=True)
    client.hset(versions.DEPLOYMENTS_KEY, "router", deployment.as_json())
    roles = version_roles(client)["router"]
    # The file may not name version 2 (then the mirror is stale and the file's default wins).
    assert roles in ({"1": "active", "2": "canary"}, {"1": "active"})


# ---- the page: the Versions table as the dashboard's own script writes it -----------------------------------

NODE = shutil.which("node")
# A stand-in document: every element the script asks for by id, a fetch that never answers (the test calls
# the table's function itself), no charts.
STAND_IN = """
const vm = require("vm");
const elements = {};
const element = id => elements[id] ??= {id, innerHTML: "", textContent: "", title: "", hidden: false, style: {}, dataset: {},
  className: "", parentElement: {title: ""}, classList: {add() {}, remove() {}, toggle() {}}, addEventListener() {}};
const context = {
  document: {getElementById: element, querySelectorAll: () => [], addEventListener() {}, hidden: true},
  window: {addEventListener() {}}, fetch: () => new Promise(() => {}), setTimeout: () => 0, clearTimeout() {},
  console, Date, Math, Number, String, Array, Object, JSON, Promise, Intl,
};
vm.createContext(context);
vm.runInContext(SCRIPT + "\\nthis.versionsTable = versionsTable;", context);
context.versionsTable(DATA);
process.stdout.write(elements["versions"].innerHTML);
"""


def versions_table_html(data: dict) -> str:
    page = (ROOT / "templates" / "dashboard.html").read_text()
    script = page.split('<script>\n"use strict";', 1)[1].split("</script>", 1)[0]
    program = STAND_IN.replace("SCRIPT", json.dumps(script)).replace("DATA", json.dumps(data))
    result = subprocess.run([NODE, "-e", program], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.skipif(NODE is None, reason="Node.js is not installed")
def test_the_versions_table_shows_each_versions_figures():
    window = metrics.Window(seconds=60, counters=counters_of(CANARY_TRAFFIC))
    data = {"versions": version_rows(window, {"router": {"1": "active", "2": "canary"}}),
            "score_buckets": list(SCORE_BUCKETS)}  # fmt: skip
    html = versions_table_html(data)
    rows = html.split("</tr>")
    header, active, canary = rows[0], next(r for r in rows if ">active<" in r), next(r for r in rows if ">canary<" in r)
    for column in ("version", "role", "requests", "errors", "P50", "P99", "mean score", "scores"):
        assert f">{column}</th>" in header
    assert 'class="badge role-active">active<' in active and 'class="badge role-canary">canary<' in canary
    assert "<td>router</td><td>1</td>" in active and "<td>router</td><td>2</td>" in canary
    assert ">90<" in active and "0.0%" in active and ">10<" in canary and "10.0%" in canary
    assert "0.600" in active and "0.350" in canary
    # The histogram: one bar per bucket, the full bar where the scores are, and its figures in the title.
    bars = canary.split('class="spark"', 1)[1].split(">", 1)[1].split("<", 1)[0]
    assert len(bars) == len(SCORE_BUCKETS) + 1 and bars[score_bucket(0.35)] == "\u2588"
    assert "0.3 to 0.4: 9" in canary
    embedding = next(r for r in rows if ">embedding<" in r)
    assert "no scores" in embedding


@pytest.mark.skipif(NODE is None, reason="Node.js is not installed")
def test_the_versions_table_says_none_before_any_version_answered():
    assert "none" in versions_table_html({})
