"""The API keys and usage pages in a browser: a person makes a key, sees its secret once and revokes
it, and both pages (with a key listed, a new secret shown, usage rows and a refused period) have no
serious accessibility violations at 1366 and 390 px (axe-core, as tests/browser/test_widths_and_a11y.py)."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import in_db
from tests.browser.test_widths_and_a11y import AXE, axe_violations

pytestmark = [pytest.mark.browser, pytest.mark.integration]


@pytest.mark.skipif(not AXE.exists(), reason="axe-core is not installed (npm ci --prefix tests/browser)")
def test_a_person_makes_and_revokes_a_key_and_the_pages_pass_axe(open_browser, stack, django_db_blocker):
    def some_usage() -> None:
        from datetime import UTC, datetime

        from django.contrib.auth import get_user_model

        from accounts.models import Usage

        user = get_user_model().objects.get(username="tester")
        Usage.objects.get_or_create(
            day=datetime.now(UTC).date(), user=user, model="router", defaults={"requests": 3, "inputs": 4, "tokens": 40}
        )

    in_db(django_db_blocker, some_usage)
    person = open_browser("tester")
    page = person.new_page()
    problems: list[str] = []
    for width in (1366, 390):
        page.set_viewport_size({"width": width, "height": 900})
        person.goto(page, "/keys/")
        page.get_by_role("textbox", name="Name:").fill(f"laptop {width}")
        page.get_by_role("button", name="Make key").click()
        secret = page.get_by_label("Key", exact=True)
        expect(secret).to_have_value(re.compile(r"^ipk_"))
        problems += [f"@{width} {line}" for line in axe_violations(page)]
        page.get_by_role("button", name=f"Revoke laptop {width}").click()
        expect(page.get_by_text("is revoked")).to_be_visible()
        problems += [f"@{width} {line}" for line in axe_violations(page)]
        person.goto(page, "/usage/")
        expect(page.get_by_role("cell", name="router")).to_be_visible()
        problems += [f"@{width} {line}" for line in axe_violations(page)]
        person.goto(page, "/usage/?start=nonsense")
        expect(page.locator(".form-error")).to_be_visible()
        problems += [f"@{width} {line}" for line in axe_violations(page)]
    assert problems == [], "accessibility violations:\n" + "\n".join(problems)
