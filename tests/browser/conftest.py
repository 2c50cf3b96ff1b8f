"""Debian's Chromium driven by Playwright against the live test stack (tests/conftest.py `stack`).

Nothing is downloaded at run time: Playwright's Python package carries its own driver, and the browser
is the system's /usr/bin/chromium (`.ci/run` installs Debian's `chromium` when it is missing). Without
it these tests skip and say so.

Every page a test opens records its JavaScript errors (uncaught exceptions and console errors), the
resources that failed to load (a page's own 4xx aside: a form with errors is a 400 on purpose) and any
5xx answer; `Browser.assert_clean()` fails the test on any of them. Screenshots are 1366x900; they go
to docs/screenshots/ when SCREENSHOTS=1 (to be committed for the README), else to a temp folder.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import requests

from tests.conftest import ROOT, TESTER_PASSWORD

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
VIEWPORT = {"width": 1366, "height": 900}
# Default wait for one condition on a page (Playwright's expect and locator actions), in ms.
WAIT_MS = 15_000

T = TypeVar("T")


def pytest_collection_modifyitems(items):
    if CHROMIUM.exists():
        return
    skip = pytest.mark.skip(
        reason=f"Debian's Chromium is not installed at {CHROMIUM} (.ci/run installs it: apt-get install chromium)"
    )
    for item in items:
        if "browser" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory) -> Path:
    if os.environ.get("SCREENSHOTS") == "1":
        target = ROOT / "docs" / "screenshots"
        target.mkdir(parents=True, exist_ok=True)
        return target
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def chromium(stack) -> Iterator[Any]:
    # After the stack: its set-up makes synchronous database calls, which Django refuses once
    # Playwright's event loop runs on this thread.
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@dataclass
class Browser:
    """One browser context (one person's cookies), its pages, and what went wrong on them."""

    context: Any
    base_url: str
    shots: Path
    errors: list[str] = field(default_factory=list)
    # Pages answered with a 4xx on purpose (a form with errors is a 400, a missing job a 404): Chromium
    # logs "Failed to load resource" for them too, which is no fault of the page.
    documents_4xx: set[str] = field(default_factory=set)
    failed_loads: list[tuple[str, str]] = field(default_factory=list)

    def new_page(self) -> Any:
        page = self.context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.on("pageerror", lambda error: self.errors.append(f"{page.url}: uncaught {error}"))
        page.on("console", lambda msg: self._console(page, msg))
        page.on("response", self._response)
        page.on("dialog", lambda dialog: dialog.accept())  # "Cancel this job?" confirmations
        return page

    def _console(self, page: Any, msg: Any) -> None:
        if msg.type != "error":
            return
        where = msg.location.get("url", "")
        if msg.text.startswith("Failed to load resource"):
            self.failed_loads.append((where, f"{page.url}: {msg.text} ({where})"))
        else:
            self.errors.append(f"{page.url}: console error: {msg.text} ({where})")

    def _response(self, response: Any) -> None:
        if response.status >= 500:
            self.errors.append(f"{response.request.method} {response.url} answered {response.status}")
        elif response.status >= 400 and response.request.resource_type == "document":
            self.documents_4xx.add(response.url)

    def goto(self, page: Any, path: str) -> Any:
        return page.goto(self.base_url + path)

    def screenshot(self, page: Any, name: str) -> Path:
        path = self.shots / f"{name}.png"
        page.screenshot(path=str(path))
        return path

    def assert_clean(self) -> None:
        """No uncaught exception, console error, 5xx, nor a resource that failed to load (a page's own 4xx aside)."""
        failed = [text for url, text in self.failed_loads if url not in self.documents_4xx]
        problems = self.errors + [f"{text} [console error]" for text in failed]
        assert problems == [], "errors on the pages:\n" + "\n".join(problems)


def log_in(page: Any, username: str, password: str = TESTER_PASSWORD) -> None:
    """Fill the login form as a person would: label, label, button."""
    page.get_by_label(re.compile(r"user ?name", re.I)).fill(username)
    page.get_by_label(re.compile(r"password", re.I)).fill(password)
    page.get_by_role("button", name=re.compile(r"log ?in|sign ?in", re.I)).click()


@pytest.fixture(scope="module")
def sessions() -> dict[str, Any]:
    """Each user's cookies after one login through the login page, shared by the module's tests."""
    return {}


@pytest.fixture
def open_browser(chromium, stack, sessions, screenshot_dir) -> Iterator[Callable[..., Browser]]:
    """open_browser(user=None): a fresh context, logged in as `user` (through the login page, once per module)."""
    from playwright.sync_api import expect

    opened: list[Browser] = []

    def make(user: str | None = None) -> Browser:
        if user and user not in sessions:
            anonymous = make(None)
            page = anonymous.new_page()
            anonymous.goto(page, "/accounts/login/")
            log_in(page, user)
            expect(page).not_to_have_url(re.compile(r"/login/"))
            sessions[user] = anonymous.context.storage_state()
        context = chromium.new_context(
            viewport=VIEWPORT, storage_state=sessions.get(user) if user else None, base_url=stack.url
        )
        browser = Browser(context=context, base_url=stack.url, shots=screenshot_dir)
        opened.append(browser)
        return browser

    yield make
    for browser in opened:
        browser.context.close()


def in_db(django_db_blocker, work: Callable[[], T]) -> T:
    """Run ORM code in a plain thread: Playwright's sync API keeps an event loop on the test's thread,
    where Django refuses synchronous database calls."""

    def run() -> T:
        from django.db import connection

        try:
            with django_db_blocker.unblock():
                return work()
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result(timeout=60)


class Load:
    """Threads sending predictions until stopped (or for at most `max_s`), counting answers by status."""

    def __init__(self, stack: Any, clients: int = 4, max_s: float = 45.0) -> None:
        self.stack, self.clients, self.max_s = stack, clients, max_s
        self.stop = threading.Event()
        self.statuses: dict[int, int] = {}
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def _run(self, n: int, token: str) -> None:
        deadline = time.monotonic() + self.max_s
        i = 0
        while not self.stop.is_set() and time.monotonic() < deadline:
            i += 1
            try:
                status = self.stack.predict("router", [f"where is my parcel {n}-{i}"], token=token).status_code
            except requests.RequestException:
                status = 0
            with self.lock:
                self.statuses[status] = self.statuses.get(status, 0) + 1

    def __enter__(self) -> Load:
        tokens = [self.stack.token, self.stack.other_token, self.stack.third_token]
        for n in range(self.clients):
            thread = threading.Thread(target=self._run, args=(n, tokens[n % len(tokens)]), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=35)
