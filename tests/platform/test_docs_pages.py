"""The API docs (Swagger UI at /api/docs/, Redoc at /api/redoc/): a way back to the product and between the two,
online inference listed first, a page language, and nothing loaded from another host (issue 24)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.jobs.factories import user

pytestmark = pytest.mark.django_db
CHROMIUM = Path("/usr/bin/chromium")


def header(html: str) -> str:
    return html[html.index('<header class="docs-bar">') : html.index("</header>")]


def test_swagger_links_back_to_the_product_and_to_redoc(client):
    html = client.get("/api/docs/").content.decode()
    assert html.startswith("<!DOCTYPE html>") and '<html lang="en">' in html
    bar = header(html)
    assert 'href="/jobs/"' in bar and 'href="/api/redoc/"' in bar and 'href="/accounts/login/?next=/api/docs/"' in bar
    assert 'href="/api/docs/" aria-current="page"' in bar
    assert "/dashboard/" not in bar and "/admin/" not in bar  # not for people who cannot open them
    assert '<a class="docs-skip" href="#docs-main">' in html and 'id="docs-main"' in html


def test_staff_get_the_dashboard_and_the_admin_from_the_docs(client):
    client.force_login(user("operator", staff=True))
    for path in ("/api/docs/", "/api/redoc/"):
        bar = header(client.get(path).content.decode())
        assert 'href="/dashboard/"' in bar and 'href="/admin/"' in bar and 'href="/jobs/"' in bar
        assert "Log in" not in bar


def test_redoc_links_back_to_swagger(client):
    html = client.get("/api/redoc/").content.decode()
    assert '<html lang="en">' in html
    bar = header(html)
    assert 'href="/api/docs/"' in bar and 'href="/api/redoc/" aria-current="page"' in bar and 'href="/jobs/"' in bar


@pytest.mark.parametrize("path", ["/api/docs/", "/api/redoc/"])
def test_the_docs_load_nothing_from_another_host(client, path):
    html = client.get(path).content.decode()
    assert not re.search(r'(src|href)="(https?:)?//', html), "an asset from another host"
    assert "fonts.googleapis.com" not in html and "/static/drf_spectacular_sidecar/" in html


def test_redoc_may_not_fetch_its_logo_from_its_cdn(client):
    """Redoc's sidebar shows a logo from cdn.redoc.ly that no setting turns off: the page's policy forbids it."""
    html = client.get("/api/redoc/").content.decode()
    assert re.search(r"""<meta http-equiv="Content-Security-Policy" content="img-src 'self' data: blob:;""", html)


def test_online_inference_is_the_first_section_and_predict_its_first_operation(client):
    schema = client.get("/api/schema/?format=json").json()
    assert [tag["name"] for tag in schema["tags"]] == ["predict", "jobs", "account", "health"]
    paths = list(schema["paths"])
    assert paths[:2] == ["/api/v1/models/{name}/predict", "/api/v1/models"]
    sections = {op["tags"][0] for ops in schema["paths"].values() for op in ops.values()}
    assert sections == {"predict", "jobs", "account", "health"}  # every operation in a named section
    assert "/api/schema/" not in schema["paths"]  # the schema does not describe itself (SERVE_INCLUDE_SCHEMA)


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"Debian's Chromium is not installed at {CHROMIUM}")
def test_swagger_ui_shows_predict_first_and_the_way_back(live_server):
    """In the browser: Swagger UI (served locally) lists the predict section first, under the docs' header."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"], headless=True)
        page = browser.new_page(viewport={"width": 1366, "height": 900})
        elsewhere: list[str] = []
        page.on("request", lambda r: None if r.url.startswith((live_server.url, "data:")) else elsewhere.append(r.url))
        page.goto(f"{live_server.url}/api/docs/")
        first = page.locator(".opblock-tag-section").first
        expect(first.locator("h3")).to_contain_text("predict", timeout=15_000)
        expect(first.locator(".opblock").first).to_contain_text("/api/v1/models/{name}/predict")
        docs = page.get_by_role("navigation", name="API documentation")
        expect(docs.get_by_role("link", name="Redoc (read it)")).to_have_attribute("href", "/api/redoc/")
        expect(page.get_by_role("navigation", name="Product").get_by_role("link", name="Jobs")).to_be_visible()
        browser.close()
    assert elsewhere == []
