"""The dashboard's script in Debian's Chromium, fed a data.json made for each case: what a person reads on the
page (the charts' figures as text, the host tiles beside the verdict, Flower's counts beside the page's).

The page is served by Django's live server and its data.json answered by the test (Playwright's routing),
so the figures are known to the digit and no stack has to be started; what the server puts in data.json
is tested in tests/observability/test_dashboard_host_and_flower.py and test_dashboard_data.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.jobs.factories import user

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"Debian's Chromium is not installed at {CHROMIUM}"),
]
STEP_S = 5
BUCKETS = 180  # 15 minutes in 5 s steps, as observability/dashboard.py sends them


def clock(epoch_s: float) -> str:
    """A time as the page writes it (the browser runs in UTC here)."""
    return time.strftime("%H:%M:%S", time.gmtime(epoch_s))


def data_json(now: float, **changes: Any) -> dict[str, Any]:
    """A data.json of a platform under a steady load: figures chosen to be told apart on the page."""
    t0 = int(now) - BUCKETS * STEP_S
    t = [t0 + i * STEP_S for i in range(BUCKETS)]
    p99 = [40.0] * BUCKETS
    p99[100] = 180.0  # one slow step: the peak
    data: dict[str, Any] = {
        "now": now,
        "series": {
            "t": t,
            "p50_ms": [12.0] * BUCKETS,
            "p95_ms": [30.0] * BUCKETS,
            "p99_ms": p99,
            "status_per_s": {
                "2xx": [20.0] * BUCKETS,
                "4xx": [0.0] * BUCKETS,
                "429": [0.0] * BUCKETS,
                "503": [0.0] * (BUCKETS - 1) + [2.5],
                "504": [0.0] * BUCKETS,
                "5xx": [0.0] * BUCKETS,
            },
            "online_depth": [3] * BUCKETS,
            "offline_depth": [0] * BUCKETS,
        },  # fmt: skip
        "host": {"cores": 2, "cpu_pct": 97.0, "load1": 3.4, "load5": 2.9, "cpu_findings": []},
        "verdict": {"text": "no jam: last 60 s: 20.0 requests/s", "findings": []},
        "workers": [
            {"id": "h:101", "queue": "online", "models": ["router"], "state": "busy", "batches": 9},
            {"id": "h:102", "queue": "online", "models": ["router"], "state": "idle", "batches": 7},
            {"id": "h:201", "queue": "offline", "models": ["router"], "state": "busy", "batches": 3},
        ],
        "celery_workers": [
            {"id": "h:100", "queue": "online", "processes": 2},
            {"id": "h:200", "queue": "offline", "processes": 1},
        ],
    }
    data.update(changes)
    return data


@pytest.fixture
def dashboard(live_server, settings) -> Iterator[tuple[Any, dict[str, Any]]]:
    """(page, answer): the dashboard open as a staff member; data.json answers what `answer["data"]` holds."""
    from django.test import Client  # (this folder's `client` fixture is a Redis client)
    from playwright.sync_api import expect, sync_playwright

    client = Client()
    settings.FLOWER_URL = "http://127.0.0.1:5599/"
    client.force_login(user("operator", staff=True))  # before Playwright's event loop: Django refuses ORM calls in one
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    answer = {"data": data_json(time.time())}
    expect.set_options(timeout=10_000)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"], headless=True)
        context = browser.new_context(viewport={"width": 1366, "height": 900}, timezone_id="UTC")
        context.add_cookies([{"name": settings.SESSION_COOKIE_NAME, "value": session, "url": live_server.url}])
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.route("**/dashboard/data.json", lambda route: route.fulfill(json=answer["data"]))
        page.goto(f"{live_server.url}/dashboard/")
        yield page, answer
        browser.close()
    assert errors == [], errors


def test_each_chart_gives_its_figures_as_text(dashboard):
    from playwright.sync_api import expect

    page, answer = dashboard
    t = answer["data"]["series"]["t"]
    latest, peak = clock(t[-1] + STEP_S), clock(t[100] + STEP_S)
    summary = page.locator("#s-c-latency")
    expect(summary).to_have_text(f"Latest {latest}: P50 12.0, P95 30.0, P99 40.0 ms; peak P99 180 ms at {peak}")
    # The canvas (an image to assistive technology) is described by that line.
    assert page.locator("#c-latency").get_attribute("aria-describedby") == "s-c-latency"
    assert page.locator("#c-latency").get_attribute("role") == "img"

    page.locator("#s-c-latency").click()  # opens the table
    rows = page.locator("#f-c-latency tr")
    expect(rows.nth(3)).to_be_visible()
    # Per series: latest, mean over the 15 minutes, peak and when.
    mean_p99 = (40.0 * (BUCKETS - 1) + 180.0) / BUCKETS
    assert [c.strip() for c in rows.nth(3).locator("th, td").all_inner_texts()] == [
        "P99", "40.0", f"{mean_p99:.1f}", "180", peak,
    ]  # fmt: skip
    assert "Latency, ms, in 5 s steps" in page.locator("#f-c-latency caption").inner_text()

    # The stacked chart says its total and names only the statuses above 0 now.
    expect(page.locator("#s-c-status")).to_have_text(
        f"Latest {latest}: total 22.5 req/s (2xx 20.0, 503 2.5); peak total 22.5 req/s at {latest}"
    )


def test_the_figures_follow_the_chart_when_it_updates(dashboard):
    from playwright.sync_api import expect

    page, answer = dashboard
    expect(page.locator("#s-c-depth")).to_contain_text("online requests 3, offline chunks 0")
    data = data_json(time.time())
    data["series"]["offline_depth"][-1] = 7
    answer["data"] = data  # the next poll (every 2 s) gets it
    expect(page.locator("#s-c-depth")).to_contain_text("online requests 3, offline chunks 7")
    expect(page.locator("#s-c-depth")).to_contain_text("peak offline chunks 7 waiting or in flight")


def test_a_busy_cpu_under_load_is_expected_unless_the_verdict_blames_it(dashboard):
    from playwright.sync_api import expect

    page, answer = dashboard
    # 97% CPU, load 3.4 on 2 cores, and a verdict of no jam: busy, said to be expected, nothing red.
    expect(page.locator("#t-cpu-why")).to_have_text("busy: expected")
    expect(page.locator("#t-cpu-verdict")).to_have_text("no")
    for tile in ("#tile-cpu", "#tile-load1", "#tile-load5", "#tile-cpu-verdict"):
        expect(page.locator(tile)).not_to_have_class(re.compile(r"\bhot\b"))
    expect(page.locator("#g-host")).to_contain_text("A busy CPU under load is expected and no jam by itself")

    symptom = "host CPU saturated (every process waits for a core)"
    answer["data"] = data_json(time.time(), host={**answer["data"]["host"], "cpu_findings": [symptom]})
    expect(page.locator("#t-cpu-verdict")).to_have_text("yes")
    expect(page.locator("#t-cpu-why")).to_have_text(symptom)
    for tile in ("#tile-cpu", "#tile-load1", "#tile-cpu-verdict"):
        expect(page.locator(tile)).to_have_class(re.compile(r"\bhot\b"))


def test_flowers_counts_are_set_beside_the_pages_and_its_link_follows_flower_url(dashboard):
    from playwright.sync_api import expect

    page, _ = dashboard
    assert page.get_by_role("link", name="Flower", exact=True).get_attribute("href") == "http://127.0.0.1:5599/"
    expect(page.locator("#t-celery")).to_have_text("2")
    expect(page.locator("#t-workers")).to_have_text("3")
    why = page.locator("#flower-why")
    expect(why.locator("summary")).to_contain_text(
        "Flower counts differently: 2 Celery workers and batches, where this page counts 3 worker processes and requests"
    )
    why.locator("summary").click()
    expect(why).to_contain_text("2 now: online (h:100, 2 processes), offline (h:200, 1 process)")
    expect(why).to_contain_text('Flower\'s "Active tasks" stay 0 while work runs')
    expect(why).to_contain_text("Processes busy at their last heartbeat here: 2 (online, offline)")
    expect(why).to_contain_text("A Flower task is one batch, not one request")
