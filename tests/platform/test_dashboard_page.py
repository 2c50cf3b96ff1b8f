"""The dashboard page: staff only, and it carries every chart, legend and tile its script fills in.

The script itself (ticks, hover, tiles from data.json) is checked in a real browser (tests/browser);
this checks what the server sends, without a live stack.
"""

from __future__ import annotations

import re

import pytest

from tests.jobs.factories import user

pytestmark = pytest.mark.django_db

STATUSES = ("2xx", "4xx", "429", "503", "504", "5xx")
CHARTS = ("c-status", "c-errors", "c-latency", "c-depth")


@pytest.fixture
def page(client) -> str:
    client.force_login(user("operator", staff=True))
    response = client.get("/dashboard/")
    assert response.status_code == 200
    return response.content.decode()


def test_dashboard_is_for_staff_only(client):
    """Anonymous: the product's login page (not the admin's); signed in but not staff: the styled 403."""
    anonymous = client.get("/dashboard/")
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/accounts/login/?next=/dashboard/")
    client.force_login(user("someone"))
    refused = client.get("/dashboard/")
    assert refused.status_code == 403 and b"does not have permission for this page" in refused.content
    assert client.get("/dashboard/data.json").status_code == 403


def test_every_chart_has_a_canvas_a_legend_and_a_unit(page):
    for chart in CHARTS:
        assert f'<canvas id="{chart}"' in page
        legend = re.search(rf'<span class="legend"[^>]*data-chart="{chart}"[^>]*>', page)
        assert legend, f"no legend for {chart}"
        assert re.search(r'data-unit="[^"]+"', legend.group(0)), f"{chart} has no unit"
    # Status chart: every status class; errors chart: every one but 2xx; latency: P50, P95 and P99.
    for status in STATUSES:
        assert f'data-key="{status}"' in legend_of(page, "c-status")
    assert 'data-key="2xx"' not in legend_of(page, "c-errors")
    for pct in ("p50_ms", "p95_ms", "p99_ms"):
        assert f'data-key="{pct}"' in legend_of(page, "c-latency")


def test_status_tiles_use_the_colours_of_the_chart_legend(page):
    legend = legend_of(page, "c-status")
    for status in STATUSES:
        colour = re.search(rf'data-key="{status}" data-color="(#[0-9A-Fa-f]{{6}})"', legend).group(1)
        assert re.search(rf'<div class="tile" id="tile-{status}" style="--c:{colour}">', page), status
        assert f'id="rq-{status}-now"' in page and f'id="rq-{status}-min"' in page


def test_host_worker_and_queue_sections_are_there(page):
    for element in "t-cpu t-load1 t-load5 t-cores t-p50 t-p95 t-p99 queues workers jobs slow".split():
        assert f'id="{element}"' in page
    assert "Platform dashboard" in page and "data.json" in page


def test_nothing_is_loaded_from_another_host(page):
    assert not re.search(r'<(script|link)[^>]+(src|href)="(https?:)?//', page)


def legend_of(page: str, chart: str) -> str:
    start = re.search(rf'<span class="legend"[^>]*data-chart="{chart}"', page).start()
    return page[start : page.index("</span></div>", start)]


def test_each_offline_rate_says_its_window(page):
    """Issue 24: the tile (a one-minute rate of all jobs, put first so a narrow tile never cuts it) and the jobs table (each job's own rate since it
    started) showed two different rows/s side by side with no word on which is which."""
    assert '1 min: <span id="t-rows">–</span> rows/s' in page  # as the request tiles say their minute
    assert "rows written per second by all jobs over the last minute" in page
    assert '"rows/s since start"' in page


def test_the_queue_depth_chart_says_it_counts_requests_in_flight_too(page):
    """Issue 24: its axis said "queued" while it plots waiting plus in-flight requests (and chunks)."""
    assert 'data-chart="c-depth" data-unit="waiting or in flight"' in page
