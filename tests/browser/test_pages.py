"""The product as a person uses it, in Debian's Chromium: log in, watch the dashboard under load, run,
follow, cancel and retry CSV jobs, correct a label in the admin review.

Selectors are roles, labels and visible text, so a restyled page keeps its tests. Every wait is on a
condition with a timeout (Playwright's expect / wait_for_function), never a fixed sleep. Each test
ends with no JavaScript error, console error, failed resource load or 5xx on any page it opened.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import expect

from tests.browser.conftest import Load, in_db, log_in
from tests.conftest import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.integration]

TEXTS = [
    "where is my parcel {i}",
    "I was charged twice on invoice {i}, refund please",
    "the app crashes when I open screen {i}",
    "reset the password of user {i}",
]
ENDED = {"succeeded", "partial", "failed", "cancelled"}


# Helpers -----------------------------------------------------------------------------------------


def write_csv(folder: Path, name: str, rows: int, *, empty_every: int = 0) -> Path:
    """A CSV with a header row (key, text); every `empty_every`-th text is empty, a row that fails."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["key", "text"])
    for i in range(rows):
        text = "" if empty_every and i % empty_every == 0 else TEXTS[i % len(TEXTS)].format(i=i)
        writer.writerow([f"k{i}", text])
    path = folder / name
    path.write_text(out.getvalue())
    return path


def api_job(stack, job_id: int) -> dict:
    response = requests.get(f"{stack.url}/api/v1/jobs/{job_id}", headers=stack.headers(), timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def api_rows(stack, job_id: int) -> dict[int, dict]:
    response = requests.get(
        f"{stack.url}/api/v1/jobs/{job_id}/results", params={"page_size": 1000}, headers=stack.headers(), timeout=10
    )
    assert response.status_code == 200, response.text
    return {row["index"]: row for row in response.json()["results"]}


def status_text(page: Any, status: str) -> Any:
    """The element whose whole text is the status ("Succeeded" matches, "Succeeded 3 times" would not)."""
    return page.get_by_text(re.compile(rf"^\s*{status}\s*$", re.I)).first


def wait_for_status(page: Any, status: str, timeout_s: float) -> None:
    """Until the page shows `status`: the page refreshes itself; reload it if it has not within 5 s."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining_ms = (deadline - time.monotonic()) * 1000
        try:
            expect(status_text(page, status)).to_be_visible(timeout=max(1, min(5_000, remaining_ms)))
            return
        except AssertionError:
            if remaining_ms <= 5_000:
                raise
        try:
            page.reload()
        except PlaywrightError:  # the page's own refresh began first: that one loads it
            pass


def upload(page: Any, csv_path: Path, model: str) -> int:
    """Submit the jobs page's upload form; returns the new job's id from the page it leads to."""
    page.get_by_label(re.compile(r"^\s*(csv\s+(or\s+json\s+lines\s+)?)?file", re.I)).set_input_files(str(csv_path))
    page.get_by_label(re.compile(r"^\s*model", re.I)).select_option(model)
    text_column = page.get_by_label(re.compile(r"^text column", re.I))
    if text_column.input_value() != "text":
        text_column.fill("text")
    page.get_by_role("button", name=re.compile(r"upload|run|submit", re.I)).click()
    expect(page).to_have_url(re.compile(r"/jobs/\d+/?$"))
    expect(page.get_by_text(csv_path.name).first).to_be_visible()
    return int(re.search(r"/jobs/(\d+)", page.url).group(1))


# JavaScript run in the page ----------------------------------------------------------------------

# The charts that have drawn something: canvases with a painted pixel, SVGs with marks in them.
CHARTS_DRAWN = """() => {
  const visible = (el) => { const r = el.getBoundingClientRect(); return r.width > 40 && r.height > 20; };
  const canvases = [...document.querySelectorAll("canvas")].filter(visible);
  const painted = canvases.filter((c) => {
    const ctx = c.getContext("2d");
    if (!ctx || !c.width || !c.height) return false;
    const px = ctx.getImageData(0, 0, c.width, c.height).data;
    for (let i = 3; i < px.length; i += 4) if (px[i] !== 0) return true;
    return false;
  });
  const svgs = [...document.querySelectorAll("svg")].filter(visible)
    .filter((s) => [...s.querySelectorAll("path, polyline, polygon, rect, circle, line")]
      .some((m) => { const r = m.getBoundingClientRect(); return r.width > 0 || r.height > 0; }));
  return {canvases: canvases.length, painted: painted.length, svgs: svgs.length};
}"""

# The request-rate figures on the page: for each label naming answered requests ("online QPS",
# "2xx answered", "all requests"; never a link), the numbers in its tile or row: the smallest
# ancestor with a number besides the label's own text, less time spans such as "1 min" or "5 s".
RATE_FIGURES = """() => {
  const label = /\\bqps\\b|^\\s*2xx\\b|\\ball requests\\b/i;
  const span = /\\d+(\\.\\d+)?\\s*(min|minutes?|s|sec|seconds?)\\b/gi;
  const figures = [];
  for (const el of document.querySelectorAll("body *")) {
    if (el.children.length || !el.offsetParent || el.closest("a, button, h1, h2, h3")) continue;
    const own = (el.innerText || "").trim();
    if (!own || own.length > 40 || !label.test(own)) continue;
    for (let box = el.parentElement, up = 0; box && up < 3; box = box.parentElement, up++) {
      const text = box.innerText || "";
      if (text.length > 120) break;
      const numbers = (text.replace(own, " ").replace(span, " ").match(/\\d+(\\.\\d+)?/g) || []).map(Number);
      if (numbers.length) { figures.push({label: own, numbers}); break; }
    }
  }
  return figures;
}"""

# A fingerprint of each visible canvas's pixels: it changes when a chart draws new data.
CANVAS_PRINTS = """() => [...document.querySelectorAll("canvas")]
  .filter((c) => c.width && c.height && c.getContext("2d"))
  .map((c) => { const px = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
    let h = 0; for (let i = 0; i < px.length; i += 1) h = (h * 31 + px[i]) | 0; return h; })"""


def rate_figures(page: Any) -> list[dict]:
    return page.evaluate(RATE_FIGURES)


# Tests -------------------------------------------------------------------------------------------


def test_log_in_through_the_login_page_and_log_out(open_browser, stack):
    browser = open_browser()
    page = browser.new_page()
    browser.goto(page, "/jobs/")
    expect(page).to_have_url(re.compile(r"/login/"))  # the jobs page asks who you are first
    expect(page.get_by_role("button", name=re.compile(r"log ?in|sign ?in", re.I))).to_be_visible()
    browser.screenshot(page, "login")

    log_in(page, "tester", "not-the-password")
    expect(page.get_by_text(re.compile(r"correct username and password|invalid|incorrect", re.I)).first).to_be_visible()
    expect(page).to_have_url(re.compile(r"/login/"))

    log_in(page, "tester")
    expect(page).to_have_url(re.compile(r"/jobs/$"))
    expect(page.get_by_text("tester", exact=True).first).to_be_visible()  # who is logged in

    log_out = re.compile(r"log ?out|sign ?out", re.I)
    page.get_by_role("link", name=log_out).or_(page.get_by_role("button", name=log_out)).first.click()
    expect(page.get_by_text(re.compile(r"logged out|log ?in|sign ?in", re.I)).first).to_be_visible()
    browser.goto(page, "/jobs/")
    expect(page).to_have_url(re.compile(r"/login/"))  # logged out: asked again
    browser.assert_clean()
    from platform_ import auth_throttle

    stack.redis.delete(auth_throttle.key("127.0.0.1"))  # the failed attempt above counts no more


def test_dashboard_under_load_shows_live_numbers_and_charts(open_browser, stack):
    browser = open_browser("boss")
    page = browser.new_page()
    browser.goto(page, "/dashboard/")
    expect(page.get_by_role("heading", level=1)).to_be_visible()
    # The charts drew (axes at least) before any load; note what they look like.
    page.wait_for_function(f"(() => {{ const c = ({CHARTS_DRAWN})(); return c.painted + c.svgs > 0; }})()")
    idle_prints = page.evaluate(CANVAS_PRINTS)

    with Load(stack, clients=4, max_s=60) as load:
        # A request-rate figure beside its label turns non-zero as the page refreshes under the load...
        page.wait_for_function(
            f"({RATE_FIGURES})().some((f) => f.numbers.some((n) => n > 0))", timeout=40_000, polling=500
        )
        # ...and keeps moving with the next refreshes.
        page.evaluate(f"window.seenFigures = JSON.stringify(({RATE_FIGURES})())")
        page.wait_for_function(f"JSON.stringify(({RATE_FIGURES})()) !== window.seenFigures", polling=500)
        # Every visible chart is drawn, and the load shows in them (their pixels changed since idle).
        page.wait_for_function(
            f"""(() => {{
              const c = ({CHARTS_DRAWN})(), now = ({CANVAS_PRINTS})(), idle = {json.dumps(idle_prints)};
              return c.painted + c.svgs >= 2 && c.painted === c.canvases
                && (c.svgs > 0 || now.some((p) => !idle.includes(p)));
            }})()""",
            timeout=20_000,
            polling=500,
        )
        browser.screenshot(page, "dashboard")
    assert load.statuses.get(200, 0) > 0, f"the load got no answer: {load.statuses}"
    figures = rate_figures(page)
    assert any(n > 0 for f in figures for n in f["numbers"]), figures
    browser.assert_clean()


def test_upload_a_csv_and_follow_the_job_until_it_succeeds(open_browser, stack, tmp_path):
    browser = open_browser("tester")
    page = browser.new_page()
    browser.goto(page, "/jobs/")
    expect(page.get_by_role("heading", name=re.compile(r"jobs", re.I)).first).to_be_visible()
    tickets = write_csv(tmp_path, "tickets.csv", 40)
    # A wrong text column first: the form says what is wrong and keeps what was typed.
    page.get_by_label(re.compile(r"^\s*(csv\s+(or\s+json\s+lines\s+)?)?file", re.I)).set_input_files(str(tickets))
    page.get_by_label(re.compile(r"^text column", re.I)).fill("body")
    page.get_by_role("button", name=re.compile(r"upload|run|submit", re.I)).click()
    expect(page.get_by_text(re.compile(r"text column .body. not found", re.I)).first).to_be_visible()
    expect(page.get_by_label(re.compile(r"^text column", re.I))).to_have_value("body")
    job_id = upload(page, tickets, "router")

    wait_for_status(page, "succeeded", timeout_s=60)
    expect(page.get_by_text(re.compile(r"\b40\b")).first).to_be_visible()  # 40 rows done
    assert api_job(stack, job_id)["status"] == "succeeded" and api_job(stack, job_id)["done_rows"] == 40
    rows = api_rows(stack, job_id)
    assert len(rows) == 40 and rows[0]["label"] == "shipping"  # "where is my parcel 0"
    expect(page.get_by_text("shipping").first).to_be_visible()  # the first rows with their labels
    browser.screenshot(page, "job-detail")

    browser.goto(page, "/jobs/")
    link = page.get_by_role("link", name=re.compile(rf"^\s*#?{job_id}\s*$|tickets\.csv"))
    expect(link.first).to_be_visible()
    expect(page.get_by_role("row").filter(has_text="tickets.csv").first).to_contain_text(re.compile("succeeded", re.I))
    browser.screenshot(page, "jobs-list")
    browser.assert_clean()


def test_cancel_a_running_job(open_browser, stack, tmp_path):
    browser = open_browser("tester")
    page = browser.new_page()
    browser.goto(page, "/jobs/")
    job_id = upload(page, write_csv(tmp_path, "big.csv", 3000), "router")
    wait_until(lambda: api_job(stack, job_id)["done_rows"] > 0, 60, "the job to start")

    page.get_by_role("button", name=re.compile(r"^\s*cancel", re.I)).click()
    wait_for_status(page, "cancelled", timeout_s=20)
    job = api_job(stack, job_id)
    assert job["status"] == "cancelled" and 0 < job["done_rows"] < 3000, job
    expect(page.get_by_role("button", name=re.compile(r"^\s*cancel", re.I))).to_have_count(0)  # nothing to cancel
    browser.assert_clean()


def test_a_waiting_job_says_why_and_when_and_an_ended_one_does_not(open_browser, stack, tmp_path, django_db_blocker):
    """Tester's job runs; another user's high-priority job arrives: tester's page says it waits for it, how
    much is ahead and when it should end. The offline worker is stopped meanwhile, so the page is read while
    the backlog stands still; once the jobs end, the page says none of it."""

    def may_ask_high(allowed: bool) -> None:
        from django.contrib.auth import get_user_model

        from jobs.models import UserShare

        other = get_user_model().objects.get(username="other")
        if allowed:
            UserShare.objects.update_or_create(user=other, defaults={"max_priority": "high"})
        else:
            UserShare.objects.filter(user=other).delete()

    browser = open_browser("tester")
    page = browser.new_page()
    browser.goto(page, "/jobs/")
    mine = upload(page, write_csv(tmp_path, "tickets-april.csv", 600), "router")
    wait_until(lambda: api_job(stack, mine)["done_rows"] > 0, 60, "tester's job to start")  # a rate is measured
    in_db(django_db_blocker, lambda: may_ask_high(True))
    try:
        answer = requests.post(
            f"{stack.url}/api/v1/jobs",
            files={"file": ("escalations.csv", write_csv(tmp_path, "escalations.csv", 600).read_bytes(), "text/csv")},
            data={"text_column": "text", "model": "router", "priority": "high"},
            headers={"Authorization": f"Token {stack.other_token}"},
            timeout=60,
        )
        assert answer.status_code == 202, answer.text
        urgent = answer.json()["id"]
        read = f"{stack.url}/api/v1/jobs/{urgent}"
        other = {"Authorization": f"Token {stack.other_token}"}
        wait_until(lambda: requests.get(read, headers=other, timeout=10).json()["status"] != "ingesting", 60, "read")
        os.killpg(stack.offline.pid, signal.SIGSTOP)
        try:
            # The card refreshes itself every 2 s: it comes to say where the job stands.
            expect(page.get_by_text(re.compile(r"^\s*Waiting: 1 job of higher priority\s*$")).first).to_be_visible()
            standing = page.get_by_role("status", name="Where the job stands")
            expect(standing).to_contain_text(re.compile(r"Chunks ahead\s*\d+ chunks?", re.I))
            expect(standing).to_contain_text(re.compile(r"Time left\s*(\d+ s|\d+ min \d\d s)", re.I))
            expect(page.get_by_text("Normal priority").first).to_be_visible()
            browser.screenshot(page, "job-waiting")
            listing = browser.new_page()
            browser.goto(listing, "/jobs/")
            row = listing.get_by_role("row").filter(has_text="tickets-april.csv").first
            expect(row).to_contain_text("Normal")
            expect(row).to_contain_text("waiting: 1 job of higher priority")
            expect(row).to_contain_text(re.compile(r"\d+ chunks? ahead"))
        finally:
            os.killpg(stack.offline.pid, signal.SIGCONT)
    finally:
        in_db(django_db_blocker, lambda: may_ask_high(False))

    wait_for_status(page, "succeeded", timeout_s=120)
    expect(page.get_by_role("status", name="Where the job stands")).to_have_count(0)
    expect(page.get_by_text(re.compile(r"waiting:|chunks ahead", re.I))).to_have_count(0)
    browser.assert_clean()


def test_retry_runs_again_only_the_rows_that_failed_at_run_time(open_browser, stack, tmp_path, django_db_blocker):
    from tests.jobs.factories import fail_at_run_time

    browser = open_browser("tester")
    page = browser.new_page()
    browser.goto(page, "/jobs/")
    job_id = upload(page, write_csv(tmp_path, "gaps.csv", 30, empty_every=10), "router")  # rows 0, 10, 20 empty
    wait_for_status(page, r"partial \(some rows failed\)", timeout_s=60)
    first = api_rows(stack, job_id)
    empty = sorted(i for i, row in first.items() if row["status"] == "failed")
    assert empty == [0, 10, 20] and all(first[i]["attempts"] == 0 for i in empty)
    # Empty texts would only fail again: no Retry, and the page says what would help.
    note = "3 rows failed because of their input (empty text): fix the file and upload it again"
    expect(page.locator("#job-summary").get_by_text(note)).to_be_visible()
    expect(page.get_by_role("button", name=re.compile(r"retry", re.I))).to_have_count(0)

    # Three other rows failed at run time (their batch's model raised): those a retry can help.
    in_db(django_db_blocker, lambda: fail_at_run_time(job_id, [1, 2, 3]))
    page.reload()
    page.get_by_role("button", name="Retry 3 failed rows").click()
    expect(page.get_by_text(f"Job {job_id}: 3 failed rows queued again. {note}.")).to_be_visible()
    wait_until(lambda: api_job(stack, job_id)["status"] in ENDED, 60, "the retried job to end")
    wait_for_status(page, r"partial \(some rows failed\)", timeout_s=30)
    again = api_rows(stack, job_id)
    assert [again[i]["status"] for i in (1, 2, 3)] == ["done"] * 3
    assert [again[i]["attempts"] for i in (1, 2, 3)] == [2] * 3  # run once more, by the retry
    assert [(again[i]["status"], again[i]["attempts"]) for i in empty] == [("failed", 0)] * 3  # not run again
    for index, row in first.items():  # rows that had succeeded were not run again
        if index not in (*empty, 1, 2, 3):
            assert again[index] == row
    job = api_job(stack, job_id)
    assert (job["status"], job["done_rows"], job["failed_rows"]) == ("partial", 27, 3)
    expect(page.locator("#job-summary").get_by_text(note)).to_be_visible()
    expect(page.get_by_role("button", name=re.compile(r"retry", re.I))).to_have_count(0)
    browser.assert_clean()


def test_staff_corrects_a_low_confidence_label_in_the_admin_review(open_browser, stack, tmp_path, django_db_blocker):
    # tester's job through the API; the tiny random sentiment model scores about 1/3 per label, so
    # every row is low-confidence.
    with write_csv(tmp_path, "review.csv", 12).open("rb") as data:
        created = requests.post(
            f"{stack.url}/api/v1/jobs",
            files={"file": ("review.csv", data, "text/csv")},
            data={"text_column": "text", "model": "sentiment"},
            headers=stack.headers(),
            timeout=30,
        )
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    wait_until(lambda: api_job(stack, job_id)["status"] in ENDED, 60, "the review job to end")
    rows = api_rows(stack, job_id)
    assert api_job(stack, job_id)["status"] == "succeeded" and all(r["low_confidence"] for r in rows.values())

    # Staff open the job's page, follow its link to the low-confidence rows in the admin.
    browser = open_browser("boss")
    page = browser.new_page()
    browser.goto(page, f"/jobs/{job_id}/")
    page.get_by_role("link", name=re.compile(r"review", re.I)).first.click()
    expect(page).to_have_url(re.compile(r"/admin/"))
    first_row = page.get_by_role("row").filter(has_text=TEXTS[0].format(i=0))
    expect(first_row).to_have_count(1)
    expect(page.get_by_role("row").filter(has_text=re.compile(r"where is my parcel|charged twice"))).to_have_count(6)
    browser.screenshot(page, "admin-review")

    # Row 0's page: choose the corrected label among the model's labels, save.
    target = rows[0]
    corrected = next(label for label in ("negative", "neutral", "positive") if label != target["label"])
    first_row.get_by_role("link").first.click()
    select = page.get_by_label(re.compile(r"corrected label", re.I))
    expect(select).to_be_visible()
    select.select_option(corrected)
    page.get_by_role("button", name=re.compile(r"^\s*save\s*$", re.I)).click()
    expect(page.get_by_text(re.compile(r"changed successfully", re.I)).first).to_be_visible()

    # Back on the list, the row shows its reviewer; row 1 is corrected in the list itself (its select, Save).
    expect(first_row).to_contain_text("boss")
    second_row = page.get_by_role("row").filter(has_text=TEXTS[1].format(i=1))
    second_row.get_by_role("combobox").select_option(corrected)
    with page.expect_navigation():
        page.get_by_role("button", name=re.compile(r"^\s*save\s*$", re.I)).click()
    expect(page.get_by_text(re.compile(r"changed successfully", re.I)).first).to_be_visible()
    expect(second_row).to_contain_text("boss")

    def stored() -> dict[int, tuple[str, str | None]]:
        from jobs.models import JobRow

        rows = JobRow.objects.select_related("reviewed_by").filter(job_id=job_id, index__in=[0, 1, 2])
        return {r.index: (r.corrected_label, r.reviewed_by and r.reviewed_by.username) for r in rows}

    assert in_db(django_db_blocker, stored) == {0: (corrected, "boss"), 1: (corrected, "boss"), 2: ("", None)}
    exported = api_rows(stack, job_id)
    assert [exported[i]["corrected_label"] for i in (0, 1, 2)] == [corrected, corrected, ""]
    browser.assert_clean()


def test_a_running_jobs_page_refreshes_every_part_it_shows(open_browser, stack, tmp_path):
    """Issue 24: the summary said "7456 done" while Labels said "No rows classified yet." and Rows "No
    rows."; only the summary refreshed. Now labels and rows follow it while the job runs."""
    browser = open_browser("tester")
    page = browser.new_page()
    browser.goto(page, "/jobs/")
    job_id = upload(page, write_csv(tmp_path, "live.csv", 3000), "router")
    expect(page.get_by_text("No rows classified yet.")).to_be_visible()  # nothing done when the page loaded
    wait_until(lambda: api_job(stack, job_id)["done_rows"] > 0, 60, "the job's first rows")
    # Without reloading: the labels card and the rows table fill in on their own.
    expect(page.get_by_text("No rows classified yet.")).to_have_count(0, timeout=15_000)
    expect(page.locator("#job-live table").first.get_by_role("row")).not_to_have_count(1, timeout=15_000)
    expect(page.locator("#job-live td .badge.status-succeeded").first).to_be_visible(timeout=15_000)  # a done row
    requests.post(f"{stack.url}/api/v1/jobs/{job_id}/cancel", headers=stack.headers(), timeout=10)  # free the worker
    browser.assert_clean()
