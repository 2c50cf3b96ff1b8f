"""The pages a person works in, at the widths they work at (1366, 1024, 800 and 390 px), and WCAG 2.1 AA.

What a reviewer on a laptop or a phone notices: the text being labelled is there and readable (not a
0 px column, not one letter a line), the select that corrects it is on screen, a table's key columns are
in view and a table that scrolls says so. axe-core (tests/browser/package.json, injected by Playwright)
checks each product page and the admin review for serious or critical violations.
"""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path
from typing import Any

import pytest
import requests
from playwright.sync_api import expect

from tests.browser.conftest import in_db
from tests.browser.test_pages import ENDED, api_job
from tests.conftest import ROOT, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.integration]

WIDTHS = (1366, 1024, 800, 390)
AXE = ROOT / "tests" / "browser" / "node_modules" / "axe-core" / "axe.min.js"
LONG = (
    "I was charged twice for my subscription this month and nobody answers my emails about the refund "
    "I asked for three weeks ago, so please look at invoice {i} and tell me when the money comes back"
)
SHORT = "where is my parcel {i}"


def write_tickets(folder: Path, rows: int) -> Path:
    """Long and short texts, and an empty one (a row that fails at ingest) every tenth row."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["text"])
    for i in range(rows):
        writer.writerow(["" if i % 10 == 9 else (LONG if i % 2 == 0 else SHORT).format(i=i)])
    path = folder / "tickets.csv"
    path.write_text(out.getvalue())
    return path


@pytest.fixture(scope="module")
def review_job(stack, tmp_path_factory) -> int:
    """A finished job of the tiny random sentiment model: every row is low-confidence, so all are to review."""
    path = write_tickets(tmp_path_factory.mktemp("widths"), 30)
    with path.open("rb") as data:
        created = requests.post(
            f"{stack.url}/api/v1/jobs",
            files={"file": ("tickets.csv", data, "text/csv")},
            data={"text_column": "text", "model": "sentiment"},
            headers=stack.headers(),
            timeout=30,
        )
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    wait_until(lambda: api_job(stack, job_id)["status"] in ENDED, 60, "the job to end")
    return job_id


def box(locator: Any) -> dict[str, float]:
    found = locator.bounding_box()
    assert found is not None, f"{locator} is not rendered"
    return found


def assert_in_view(page: Any, locator: Any, what: str) -> dict[str, float]:
    """The element is drawn, at least 20 px wide, and wholly inside the viewport's width."""
    width = page.viewport_size["width"]
    found = box(locator)
    assert found["width"] >= 20, f"{what} is {found['width']:.0f} px wide at {width} px"
    assert found["x"] >= 0 and found["x"] + found["width"] <= width + 1, (
        f"{what} spans {found['x']:.0f}..{found['x'] + found['width']:.0f} px, outside the {width} px viewport"
    )
    return found


def shot(browser: Any, page: Any, name: str) -> None:
    page.evaluate("window.scrollTo(0, 0)")
    browser.screenshot(page, name)


def test_the_review_list_shows_the_text_and_its_select_at_every_width(open_browser, stack, review_job):
    browser = open_browser("boss")
    page = browser.new_page()
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        browser.goto(page, f"/admin/jobs/jobrow/?job__id__exact={review_job}&low_confidence__exact=1")
        row = page.get_by_role("row").filter(has_text="nobody answers my emails").first
        text = row.locator("td.field-short_text")
        expect(text).to_contain_text("charged twice")
        # At 900 px and below the text column measured 0 px: now it is a readable width everywhere.
        found = assert_in_view(page, text, "the text cell")
        assert found["width"] >= 200, f"the text cell is {found['width']:.0f} px wide at {width} px"
        select = row.get_by_role("combobox", name=re.compile(r"corrected label for row \d+", re.I))
        assert_in_view(page, select, "the corrected-label select")
        # The score is shown whole ("0.19…" at 390 px before).
        score = row.locator("td.field-score_shown")
        assert_in_view(page, score, "the score")
        assert score.evaluate("el => el.scrollWidth <= el.clientWidth"), f"the score is cut off at {width} px"
        shot(browser, page, f"admin-review-{width}")
    browser.assert_clean()


def test_the_jobs_list_keeps_its_key_columns_in_view_and_says_when_it_scrolls(open_browser, stack, review_job):
    browser = open_browser("boss")
    page = browser.new_page()
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        browser.goto(page, "/jobs/")
        row = page.locator("#job-rows tr").filter(has=page.locator(f"a[href='/jobs/{review_job}/']")).first
        for label in ("Job", "File", "Status", "Progress", "Failed"):
            assert_in_view(page, row.locator(f"td[data-label='{label}']"), f"the {label} cell at {width} px")
        scroller = page.locator(".scroll").filter(has=page.locator("#job-rows"))
        hint = scroller.locator("xpath=following-sibling::p[contains(@class, 'scroll-hint')]")
        overflows = scroller.evaluate("el => el.scrollWidth - el.clientWidth > 2")
        if overflows:  # some columns are off to the right: the page says so
            expect(hint).to_be_visible()
            expect(scroller).to_have_class(re.compile(r"\bmore-right\b"))
        else:
            expect(hint).to_be_hidden()
        if width == 1366:  # a laptop sees every column, "Created" included
            assert not overflows, "the jobs table scrolls at 1366 px"
            assert_in_view(page, row.locator("td[data-label='Created']"), "the Created cell")
        page.locator("#recent-jobs").scroll_into_view_if_needed()
        browser.screenshot(page, f"jobs-list-{width}")
    browser.assert_clean()


def test_a_jobs_rows_are_readable_at_every_width(open_browser, stack, review_job):
    browser = open_browser("boss")
    page = browser.new_page()
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        browser.goto(page, f"/jobs/{review_job}/")
        row = page.locator("#rows ~ .scroll tbody tr").filter(has_text="nobody answers my emails").first
        text = row.locator("td.text-cell")
        found = assert_in_view(page, text, "the text cell")
        # Whole words a line, not fragments: the cell is wide enough for several words a line.
        assert found["width"] >= 200, f"the text cell is {found['width']:.0f} px wide at {width} px"
        words_per_line = text.evaluate(
            """el => { const lines = Math.round(el.getBoundingClientRect().height / parseFloat(getComputedStyle(el).lineHeight));
                       return el.textContent.trim().split(/\\s+/).length / Math.max(lines, 1); }"""
        )
        assert words_per_line >= 3, f"{words_per_line:.1f} words a line in the text cell at {width} px"
        for label in ("Row", "Status", "Label", "Score"):
            assert_in_view(page, row.locator(f"td[data-label='{label}']"), f"the {label} cell at {width} px")
        # Rows are numbered from 1, as the API's `row` and the exports number them.
        first = page.locator("#rows ~ .scroll tbody tr").first.locator("td[data-label='Row']")
        expect(first).to_have_text("1")
        page.locator("#rows").scroll_into_view_if_needed()
        browser.screenshot(page, f"job-detail-{width}")
    browser.assert_clean()


def axe_violations(page: Any) -> list[str]:
    """axe-core's serious and critical violations on the page, one line each with the first offenders."""
    assert AXE.exists(), f"{AXE} is missing: in CI the accessibility check must run (npm ci --prefix tests/browser)"
    page.add_script_tag(path=str(AXE))
    found = page.evaluate(
        """async () => (await axe.run(document, {runOnly: {type: "tag", values: ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa", "best-practice"]}}))
             .violations.filter(v => v.impact === "serious" || v.impact === "critical")
             .map(v => `${v.impact} ${v.id} (${v.nodes.length}): ${v.nodes.slice(0, 3).map(n => n.target.join(" ")).join(", ")}`)"""
    )
    return [f"{page.url}: {line}" for line in found]


@pytest.mark.skipif(
    not AXE.exists() and os.environ.get("CI") != "true",
    reason="axe-core is not installed: `make test` runs `npm ci --prefix tests/browser` where npm is",
)
def test_product_pages_and_the_admin_review_have_no_serious_accessibility_violations(
    open_browser, stack, review_job, django_db_blocker
):
    def a_denied_user() -> None:  # a user who is not staff: the dashboard answers its 403 page
        from django.contrib.auth import get_user_model

        from tests.conftest import TESTER_PASSWORD

        user, _ = get_user_model().objects.get_or_create(username="axe-user")
        user.set_password(TESTER_PASSWORD)
        user.save()

    in_db(django_db_blocker, a_denied_user)
    staff_pages = [
        "/jobs/",
        f"/jobs/{review_job}/",
        f"/jobs/{review_job}/?low_confidence=1",
        "/dashboard/",
        f"/admin/jobs/jobrow/?job__id__exact={review_job}&low_confidence__exact=1",
        "/jobs/999999/",  # the 404 page
    ]
    problems: list[str] = []
    staff = open_browser("boss")
    page = staff.new_page()
    for width in (1366, 390):
        page.set_viewport_size({"width": width, "height": 900})
        for path in staff_pages:
            staff.goto(page, path)
            problems += [f"@{width} {line}" for line in axe_violations(page)]
        # An upload the server refuses (no file): the form with its errors.
        staff.goto(page, "/jobs/")
        page.get_by_role("button", name=re.compile("upload and run", re.I)).click()
        expect(page.locator(".form-error")).to_be_visible()
        problems += [f"@{width} {line}" for line in axe_violations(page)]
    anonymous = open_browser()
    page = anonymous.new_page()
    anonymous.goto(page, "/accounts/login/")
    problems += axe_violations(page)
    denied = open_browser("axe-user")
    page = denied.new_page()
    denied.goto(page, "/dashboard/")
    problems += axe_violations(page)
    assert problems == [], "accessibility violations:\n" + "\n".join(problems)
