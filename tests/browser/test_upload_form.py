"""The jobs page's upload form in Debian's Chromium: the chosen file's header is checked before it is sent, so a
column it lacks is said at once, every field involved is marked and the file stays chosen; after a refusal only
the server can make, focus is on the error summary, whose links lead to the fields.

Selectors are roles, labels and visible text; every wait is on a condition (Playwright's expect).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import requests
from playwright.sync_api import expect

pytestmark = [pytest.mark.browser, pytest.mark.integration]

FILE_LABEL = re.compile(r"^\s*csv\s+or\s+json\s+lines\s+file", re.I)
UPLOAD = re.compile(r"^\s*upload and run\s*$", re.I)


def jobs_page(open_browser) -> tuple[Any, Any, list[str]]:
    """The jobs page as "tester", and the list of form POSTs it sends (none, while the page's check refuses)."""
    browser = open_browser("tester")
    page = browser.new_page()
    posts: list[str] = []
    page.on("request", lambda request: posts.append(request.url) if request.method == "POST" else None)
    browser.goto(page, "/jobs/")
    return browser, page, posts


def field(page: Any, label: str) -> Any:
    return page.get_by_label(re.compile(rf"^\s*{label}", re.I))


def error_of(page: Any, label: str) -> Any:
    """The error message a field is described by (its aria-describedby's last id)."""
    ids = field(page, label).get_attribute("aria-describedby") or ""
    return page.locator(f"#{ids.split()[-1]}") if ids else page.locator("#no-error-described")


def expect_marked(page: Any, label: str, message: re.Pattern) -> None:
    """Outlined (has-error), aria-invalid, and described by its error message."""
    box = page.locator(".field").filter(has=field(page, label))
    expect(box).to_have_class(re.compile(r"\bhas-error\b"))
    expect(field(page, label)).to_have_attribute("aria-invalid", "true")
    expect(error_of(page, label)).to_have_text(message)


def chosen_file(page: Any) -> str | None:
    return page.get_by_label(FILE_LABEL).evaluate("input => input.files.length ? input.files[0].name : null")


def job_of(stack, page: Any) -> dict:
    expect(page).to_have_url(re.compile(r"/jobs/\d+/?$"))
    job_id = int(re.search(r"/jobs/(\d+)", page.url).group(1))
    response = requests.get(f"{stack.url}/api/v1/jobs/{job_id}", headers=stack.headers(), timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_file_lacking_both_columns_is_said_before_sending_and_stays_chosen(open_browser, stack, tmp_path: Path):
    browser, page, posts = jobs_page(open_browser)
    page.get_by_label(re.compile(r"^\s*model", re.I)).select_option("qa")
    # The defaults, shown where the person types.
    expect(field(page, "question column")).to_have_attribute("placeholder", "question")
    expect(field(page, "context column")).to_have_attribute("placeholder", "context")
    faq = tmp_path / "faq.csv"
    faq.write_text("id,q,passage\n1,Who wrote it?,Ada wrote it in 1843.\n")
    page.get_by_label(FILE_LABEL).set_input_files(str(faq))
    page.get_by_role("button", name=UPLOAD).click()

    summary = page.get_by_role("alert")
    expect(summary).to_contain_text("The file was not sent")
    expect(summary).to_contain_text("The file's columns are: id, q, passage")
    expect(summary).to_be_focused()
    columns = re.compile(
        r"^(Question|Context) column “(question|context)” not found in the file's header \(the default, "
        r"as the field is empty\)\. The file's columns are: id, q, passage\.$"
    )
    expect_marked(page, "question column", columns)
    expect_marked(page, "context column", columns)
    assert posts == [] and chosen_file(page) == "faq.csv"  # no round trip: the file is still there
    browser.screenshot(page, "upload-form-columns-missing")

    # Named as the file has them, the same chosen file goes.
    field(page, "question column").fill("q")
    field(page, "context column").fill("passage")
    page.get_by_role("button", name=UPLOAD).click()
    assert job_of(stack, page)["input_columns"] == {"question": "q", "context": "passage"}
    browser.assert_clean()


def test_the_check_honours_the_delimiter_and_marks_only_the_missing_key_of_a_json_lines_file(
    open_browser, stack, tmp_path: Path
):
    browser, page, posts = jobs_page(open_browser)
    tickets = tmp_path / "tickets.csv"
    tickets.write_text("key;body\nk1;where is my parcel\n")
    page.get_by_label(re.compile(r"^\s*model", re.I)).select_option("router")
    page.get_by_label(FILE_LABEL).set_input_files(str(tickets))
    field(page, "text column").fill("body")
    # Told the file is tab-separated, the header is one column named "key;body".
    page.get_by_label(re.compile(r"^\s*delimiter", re.I)).select_option("tab")
    page.get_by_role("button", name=UPLOAD).click()
    expect_marked(
        page, "text column", re.compile(r"^Text column “body” not found .* The file's columns are: key;body\.$")
    )
    assert posts == []

    faq = tmp_path / "faq.jsonl"
    faq.write_text(json.dumps({"question": "Who wrote it?", "passage": "Ada wrote it."}) + "\n")
    page.get_by_label(re.compile(r"^\s*delimiter", re.I)).select_option("")
    page.get_by_label(re.compile(r"^\s*model", re.I)).select_option("qa")
    field(page, "text column").fill("")
    page.get_by_label(FILE_LABEL).set_input_files(str(faq))
    page.get_by_role("button", name=UPLOAD).click()
    expect_marked(
        page,
        "context column",
        re.compile(
            r"^Context column “context” not found in the file's first line .* columns are: question, passage\.$"
        ),
    )
    # The earlier mark is gone, and the question column the file has is not marked.
    expect(field(page, "question column")).not_to_have_attribute("aria-invalid", "true")
    expect(page.locator(".field.has-error")).to_have_count(1)
    assert posts == [] and chosen_file(page) == "faq.jsonl"
    # A JSON lines file's records may differ (the server fails only the rows without the key): the check is
    # a warning, and the same upload a second time is sent as it is.
    expect(page.locator(".form-error")).to_contain_text("upload again unchanged")
    page.get_by_role("button", name=UPLOAD).click()
    sent = job_of(stack, page)
    assert sent["model"] == "qa" and sent["input_columns"] == {"question": "question", "context": "context"}
    browser.goto(page, "/jobs/")

    # Detected from the header (semicolons), the CSV's text column is found and the file is sent.
    page.get_by_label(re.compile(r"^\s*model", re.I)).select_option("router")
    page.get_by_label(FILE_LABEL).set_input_files(str(tickets))
    field(page, "text column").fill("body")
    page.get_by_role("button", name=UPLOAD).click()
    job = job_of(stack, page)
    assert job["text_column"] == "body" and job["delimiter"] == ";"
    browser.assert_clean()


def test_after_a_refusal_only_the_server_makes_focus_is_on_the_summary_which_links_to_the_field(
    open_browser, stack, tmp_path: Path
):
    browser, page, posts = jobs_page(open_browser)
    page.get_by_label(re.compile(r"^\s*model", re.I)).select_option("qa")
    # Both columns are in the header, so the page sends it; the server refuses a column named twice.
    twice = tmp_path / "twice.csv"
    twice.write_text("q,q,passage\nfirst?,second?,Ada wrote it.\n")
    page.get_by_label(FILE_LABEL).set_input_files(str(twice))
    field(page, "question column").fill("q")
    field(page, "context column").fill("passage")
    page.get_by_role("button", name=UPLOAD).click()

    summary = page.get_by_role("alert")
    expect(summary).to_contain_text("The job was not created")
    expect(summary).to_be_focused()  # not left on the body
    expect(summary).to_have_attribute("tabindex", "-1")
    expect(summary).to_contain_text("choose the CSV file again")
    expect(summary).not_to_contain_text("_column")  # the page's labels, not the API's field names
    assert len(posts) == 1 and chosen_file(page) is None
    expect_marked(page, "question column", re.compile(r"2 columns named 'q'"))
    browser.screenshot(page, "upload-form-server-refusal")

    summary.get_by_role("link", name=re.compile(r"^question column$", re.I)).click()
    expect(field(page, "question column")).to_be_focused()
    expect(field(page, "question column")).to_have_value("q")
    browser.assert_clean()
