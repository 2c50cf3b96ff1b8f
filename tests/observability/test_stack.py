"""Metrics, /metrics, the dashboard and `diagnose` against the live stack."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from inference.web.diagnosis import BACKLOG_MIN
from observability.keys import GAUGES_KEY, TOTAL_KEY
from tests.conftest import ROOT, wait_until
from tests.jobs.test_jobs_api import get_job, make_csv, upload

pytestmark = pytest.mark.integration


def totals(stack) -> dict[str, float]:
    return {k: float(v) for k, v in stack.redis.hgetall(TOTAL_KEY).items()}


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def scrape_metrics(stack) -> str:
    """GET /metrics as Prometheus would: with the token the web process reads too (env or var/metrics_token)."""
    from django.conf import settings

    response = requests.get(
        f"{stack.url}/metrics", headers={"Authorization": f"Bearer {settings.METRICS_TOKEN}"}, timeout=10
    )
    assert response.status_code == 200, response.text
    return response.text


MODELS = ("router", "embedding", "sentiment", "identity")


def sampled_waiting(stack, more_than: float) -> tuple[float, float]:
    """Wait for a sample of the online queues with more than `more_than` requests admitted and not
    answered; its time and that count."""

    def sample() -> tuple[float, float] | None:
        gauges = stack.redis.hgetall(GAUGES_KEY)
        waiting = float(gauges.get("gauge|online|waiting", 0)) + float(gauges.get("gauge|online|in_flight", 0))
        return (float(gauges["sampled_at"]), waiting) if waiting > more_than else None

    return wait_until(sample, 15, f"a sample with more than {more_than} online requests waiting")


def diagnose(stack, window_s: int) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", "diagnose", "--window-s", str(window_s)],
        cwd=ROOT,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_counts_match_the_requests_sent_and_the_batches_run(stack):
    before, stats_before = totals(stack), stack.stats("router")
    with ThreadPoolExecutor(8) as pool:
        ok = list(pool.map(lambda i: stack.predict("router", [f"my parcel {i} is late"]), range(24)))
    bad = [stack.predict("router", []) for _ in range(3)]
    assert all(r.status_code == 200 for r in ok) and all(r.status_code == 400 for r in bad)

    def recorded():
        now = totals(stack)
        return now if delta(now, before, "req|router|ok") >= 24 and delta(now, before, "req|router|400") >= 3 else None

    after = wait_until(recorded, 10, "the web tier's metrics")
    assert delta(after, before, "req|router|ok") == 24
    assert delta(after, before, "req|router|400") == 3
    total_latency = sum(delta(after, before, k) for k in after if k.startswith("lat|router|total|"))
    assert total_latency == 27, "one latency observation per answered request (24 ok, 3 refused as invalid)"
    stats_after = stack.stats("router")
    passes = stats_after["forward_passes"] - stats_before.get("forward_passes", 0)
    histogram = sum(delta(after, before, k) for k in after if k.startswith("bsize|router|"))
    assert histogram == passes, "the batch-size histogram counts every forward pass the worker ran"
    assert delta(after, before, "pass_texts|router") == stats_after["forward_texts"] - stats_before.get(
        "forward_texts", 0
    )

    text = scrape_metrics(stack)
    ok_line = next(
        line
        for line in text.splitlines()
        if line.startswith('inference_requests_total{model="router",outcome="ok",status="2xx"}')
    )
    assert float(ok_line.split()[-1]) == after["req|router|ok"]
    assert 'platform_queue_depth{queue="online",state="waiting"}' in text

    # Each model's own queue, with the children serving it (the stack's online worker serves them all).
    # Waited for: just after the stack starts, a sample taken before the child's first heartbeat can be
    # the latest for a moment (the offline worker's sampler runs at the lowest CPU priority).
    def per_queue() -> dict[str, str] | None:
        lines = scrape_metrics(stack).splitlines()
        samples = dict(line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))
        served = [samples.get(f'platform_worker_processes{{queue="online.{m}"}}') for m in MODELS]
        return samples if all(value is not None and float(value) >= 1 for value in served) else None

    samples = wait_until(per_queue, 15, "each model's queue with its serving children on /metrics")
    for model in MODELS:
        assert f'platform_queue_depth{{queue="online.{model}",state="waiting"}}' in samples
    assert 'platform_queue_predicted_wait_seconds{queue="online.router"}' in text  # router's rate is measured
    assert "inference_stage_latency_seconds_bucket" in text and "inference_batch_size_bucket" in text


def test_dashboard_needs_staff_and_shows_live_figures(stack):
    anonymous = requests.get(f"{stack.url}/dashboard/", timeout=10, allow_redirects=False)
    assert anonymous.status_code == 302 and "/accounts/login/" in anonymous.headers["Location"]
    not_staff = stack.browser_login("tester").get(f"{stack.url}/dashboard/data.json", timeout=10, allow_redirects=False)
    assert not_staff.status_code == 403

    staff = stack.browser_login("boss")
    page = staff.get(f"{stack.url}/dashboard/", timeout=10)
    assert page.status_code == 200 and "Platform dashboard" in page.text and "<canvas" in page.text
    # Scripts, styles and images all served locally (no CDN); links to Flower are fine.
    assert not re.search(r"""<(script|link|img)\b[^>]*(src|href)=["']?(https?:)?//""", page.text)
    stack.predict("router", ["warm the dashboard"])
    data = wait_until(
        lambda: (d := staff.get(f"{stack.url}/dashboard/data.json", timeout=10).json())["online"]["qps"] > 0 and d,
        10,
        "traffic on the dashboard",
    )
    assert {w["queue"] for w in data["workers"]} == {"online", "offline"}
    assert all(w["rss_mb"] > 0 for w in data["workers"])
    assert len(data["series"]["t"]) == 180 and any(v for v in data["series"]["qps"])
    assert data["sampled_s_ago"] is not None and data["sampled_s_ago"] < 5
    assert data["host"]["cores"] >= 1 and data["host"]["load1"] is not None
    assert set(data["requests"]["minute"]) == {"2xx", "4xx", "429", "503", "504", "5xx"}
    assert data["requests"]["minute"]["2xx"] > 0 and len(data["series"]["status_per_s"]["2xx"]) == 180
    assert all(w["last_beat_s_ago"] < 15 and w["started_at"] < data["now"] for w in data["workers"])
    assert data["verdict"]["text"]


def metric_samples(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")}


def test_offline_work_per_user_on_metrics_and_the_dashboard(stack):
    """A user's job: its rows queued on /metrics while it waits (the offline worker is stopped), its rows
    written counted once it runs, its rate on the dashboard; the queued gauge goes when the job ends."""
    queued = 'offline_queued_rows{priority="low",user="third"}'
    written = 'offline_user_rows_total{priority="low",user="third"}'
    before = metric_samples(scrape_metrics(stack)).get(written, 0.0)
    answer = upload(stack, make_csv(3000), token=stack.third_token, priority="low")
    assert answer.status_code == 202, answer.text
    job_id = answer.json()["id"]
    wait_until(lambda: get_job(stack, job_id, stack.third_token)["status"] != "ingesting", 60, "the file read")
    os.killpg(stack.offline.pid, signal.SIGSTOP)  # the job waits: the online worker's sampler still samples
    try:

        def gauge_matches() -> bool:
            job = get_job(stack, job_id, stack.third_token)
            left = job["total_rows"] - job["done_rows"] - job["failed_rows"]
            return metric_samples(scrape_metrics(stack)).get(queued) == left > 0

        wait_until(gauge_matches, 15, "the job's rows to go on /metrics")
    finally:
        os.killpg(stack.offline.pid, signal.SIGCONT)
    ended = ("succeeded", "partial", "failed", "cancelled")
    job = wait_until(lambda: (j := get_job(stack, job_id, stack.third_token))["status"] in ended and j, 120, "its end")
    assert job["status"] == "succeeded"
    after = metric_samples(scrape_metrics(stack))
    assert after.get(written, 0.0) - before >= job["done_rows"] == 3000
    wait_until(lambda: queued not in metric_samples(scrape_metrics(stack)), 10, "the gauge to go with the job")

    data = stack.browser_login("boss").get(f"{stack.url}/dashboard/data.json", timeout=10).json()
    (mine,) = [u for u in data["offline_users"] if (u["user"], u["priority"]) == ("third", "low")]
    assert mine["rows_queued"] == 0 and mine["rows_per_s"] > 0  # written within the last minute


def test_a_504_lands_in_the_slow_request_log(stack):
    stack.pause_worker()
    try:
        response = stack.predict(
            "router", ["this one will be slow"], **{"X-Deadline-Ms": "300", "X-Request-ID": "slow-one-1"}
        )
    finally:
        stack.resume_worker()
    assert response.status_code == 504
    staff = stack.browser_login("boss")
    wait_until(
        lambda: any(
            r["request_id"] == "slow-one-1"
            for r in staff.get(f"{stack.url}/dashboard/data.json", timeout=10).json()["slow"]
        ),
        10,
        "the slow-request log entry",
    )
    admin = staff.get(f"{stack.url}/admin/inference/slowrequest/", params={"q": "slow-one-1"}, timeout=10)
    assert admin.status_code == 200 and "slow-one-1" in admin.text


def test_diagnose_names_a_backlog_when_the_online_worker_stops(stack):
    """The children stop (the dispatcher still beats, so requests are admitted): within a few seconds
    of nothing being answered while requests wait, the diagnosis names the backlog."""
    children = [child["pid"] for child in stack.online_children()]
    for pid in children:
        os.kill(pid, signal.SIGSTOP)
    verdict = ""
    try:
        with ThreadPoolExecutor(24) as pool:
            futures = [
                pool.submit(stack.predict, "router", [f"stuck {i}"], **{"X-Deadline-Ms": "9000"}) for i in range(24)
            ]
            sampled_waiting(stack, more_than=BACKLOG_MIN)

            def named() -> bool:
                nonlocal verdict
                verdict = diagnose(stack, window_s=6)
                return "backlog grows over time" in verdict

            wait_until(named, 8, "the diagnosis to name the stalled backlog")
            for pid in children:
                os.kill(pid, signal.SIGCONT)
            statuses = [f.result().status_code for f in futures]
    finally:
        for pid in children:
            os.kill(pid, signal.SIGCONT)
    assert "online backlog" in verdict and "action:" in verdict, verdict
    assert statuses == [200] * 24  # resumed in time: nothing was lost while it was named


def test_diagnose_says_no_jam_on_a_healthy_stack(stack):
    wait_until(lambda: len(stack.online_children()) == 1, 30, "the online child")
    # Earlier tests' refusals and timeouts must leave the 6 s window first.
    wait_until(lambda: diagnose(stack, window_s=6).startswith("no jam"), 30, "a window without earlier tests' errors")
    for i in range(10):
        assert stack.predict("router", [f"the app crashes on start {i}"]).status_code == 200
    verdict = diagnose(stack, window_s=6)
    assert verdict.startswith("no jam: last 6 s:"), verdict
