"""One product: the login page, log out, and error pages that are styled HTML for people and JSON for API clients."""

from __future__ import annotations

import json

import pytest
from django.test import Client, RequestFactory

from platform_ import errors
from tests.jobs.factories import user

pytestmark = pytest.mark.django_db

PASSWORD = "pw-for-tests-123"  # tests/jobs/factories.py


def assert_product_page(html: str) -> None:
    """The product's layout: its name, the navigation, its stylesheet."""
    assert "Inference platform" in html and 'href="/jobs/"' in html and 'href="/api/docs/"' in html
    assert "platform/product.css" in html


def test_the_login_page_is_the_products_and_logs_in(client):
    page = client.get("/accounts/login/?next=/jobs/")
    html = page.content.decode()
    assert (
        page.status_code == 200 and "Django REST framework" not in html and "Log in to the Inference platform" in html
    )
    assert_product_page(html)
    user("alice")
    answer = client.post("/accounts/login/", {"username": "alice", "password": PASSWORD, "next": "/jobs/"})
    assert answer.status_code == 302 and answer["Location"] == "/jobs/"
    wrong = client.post("/accounts/login/", {"username": "alice", "password": "nope"})
    assert wrong.status_code == 200 and "Please enter a correct username and password" in wrong.content.decode()


def test_the_admin_login_is_the_same_page_and_takes_staff_only(client):
    page = client.get("/admin/login/?next=/admin/")
    assert page.status_code == 200 and "Log in to the Inference platform" in page.content.decode()
    user("alice")
    refused = client.post("/admin/login/", {"username": "alice", "password": PASSWORD, "next": "/admin/"})
    assert refused.status_code == 200 and "staff account" in refused.content.decode()
    user("boss", staff=True)
    answer = client.post("/admin/login/", {"username": "boss", "password": PASSWORD})
    assert answer.status_code == 302 and answer["Location"] == "/admin/"
    assert client.get("/admin/").status_code == 200


def test_every_page_has_a_log_out_form_that_works_by_post(client):
    client.force_login(user("alice"))
    html = client.get("/jobs/").content.decode()
    assert '<form method="post" action="/accounts/logout/">' in html and ">Log out</button>" in html
    assert client.get("/accounts/logout/").status_code == 405  # Django 5: logging out needs a POST
    answer = client.post("/accounts/logout/")
    assert answer.status_code == 302 and answer["Location"] == "/accounts/login/"
    assert "You are logged out." in client.get("/accounts/login/").content.decode()  # said once, on arrival
    assert "You are logged out." not in client.get("/accounts/login/").content.decode()
    assert client.get("/jobs/").status_code == 302  # logged out: back to the login page


def test_404_is_a_page_with_navigation_for_people_and_json_for_the_api(client):
    client.force_login(user("alice"))
    page = client.get("/jobs/999999/")
    html = page.content.decode()
    assert page.status_code == 404 and page["Content-Type"].startswith("text/html")
    assert_product_page(html)
    assert "Nothing here" in html and ">Log out</button>" in html
    api = client.get("/api/v1/jobs/999999")
    assert api.status_code == 404 and api.json()["code"] == "not_found" and set(api.json()) == {"detail", "code"}
    unknown = client.get("/api/v1/no-such-thing")
    assert unknown.status_code == 404 and unknown.json() == {
        "detail": "no such endpoint: /api/v1/no-such-thing",
        "code": "not_found",
    }


def test_a_csrf_failure_is_the_styled_403_without_debug_advice():
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(user("alice"))
    page = browser.post("/jobs/", {"text_column": "text"})
    html = page.content.decode()
    assert page.status_code == 403 and "DEBUG" not in html and "reload the page and send the form again" in html
    assert_product_page(html)


def test_403_and_500_pages(rf: RequestFactory):
    request = rf.get("/jobs/")
    request.user = user("alice")
    forbidden = errors.json_403(request, Exception("no"))
    assert (
        forbidden.status_code == 403
        and "not allowed" in forbidden.content.decode()
        and "DEBUG" not in forbidden.content.decode()
    )
    failed = errors.json_500(rf.get("/jobs/"))
    assert failed.status_code == 500
    assert_product_page(failed.content.decode())
    api = errors.json_500(rf.get("/api/v1/jobs"))
    assert api.status_code == 500 and json.loads(api.content) == {
        "detail": "internal server error",
        "code": "server_error",
    }
    metrics = errors.json_403(rf.get("/metrics"))
    assert metrics.status_code == 403 and json.loads(metrics.content)["code"] == "permission_denied"
    csrf = errors.csrf_failure(rf.post("/api/v1/jobs"), "CSRF token missing")
    assert csrf.status_code == 403 and json.loads(csrf.content)["code"] == "csrf_failed"


def test_pages_mark_the_current_section_for_screen_readers_and_offer_a_skip_link(client):
    """Issue 24 (WCAG 2.1 AA): the current page was marked by colour only, and there was no way to skip
    the navigation."""
    client.force_login(user("carol"))
    html = client.get("/jobs/").content.decode()
    assert '<a href="/jobs/" class="current" aria-current="page">Jobs</a>' in html
    assert '<a class="skip-link" href="#main">Skip to content</a>' in html and '<main id="main"' in html
