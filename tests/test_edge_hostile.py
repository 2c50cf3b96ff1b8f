"""Hostile clients at the edge, on the live stack: bodies nobody should have to read, foreign Host
headers, anonymous scrapes of /metrics, and guessing credentials (issue #9: no client can fail or
jam another).

Limits here come from tests/conftest.py: JOBS_MAX_UPLOAD_BYTES=300000, so an upload may be at most
300000 bytes plus 1 MiB of multipart form (platform_/bodies.py).
"""

from __future__ import annotations

import http.client
import json
import re
import secrets
import select
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

import pytest
import requests

from tests.conftest import TESTER_PASSWORD, _start, _stop, free_port, wait_until

pytestmark = pytest.mark.integration

MB = 1024 * 1024
BOUNDARY = "hostile-boundary-7d1f"


@dataclass
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes
    sent_bytes: int
    closed: bool


def _read_answer(sock: socket.socket, sent_bytes: int) -> RawAnswer:
    """Read one HTTP/1.1 response framed by Content-Length, then whether the server closed the connection."""
    sock.setblocking(True)
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        assert piece, f"the server closed the connection without an answer (after {sent_bytes} bytes sent)"
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        piece = sock.recv(65536)
        assert piece, "the answer's body was cut short"
        body += piece
    try:
        closed = sock.recv(1) == b""
    except (ConnectionResetError, TimeoutError):
        closed = True  # a reset also ends the connection: the server is not reading what follows
    return RawAnswer(int(lines[0].split()[1]), headers, body, sent_bytes, closed)


def chunked_post(url: str, path: str, total_bytes: int, headers: dict[str, str], piece_bytes: int = 64 * 1024):
    """POST `total_bytes` of multipart filler with Transfer-Encoding: chunked, as fast as the server takes it.

    Sending stops as soon as an answer can be read (or the server resets the connection), so
    `sent_bytes` tells how much the client had sent when the server answered: well short of the
    total when the server answered without reading the body.
    """
    target = urlparse(url)
    sock = socket.create_connection((target.hostname, target.port), timeout=10)
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {target.hostname}",
        "Transfer-Encoding: chunked",
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    sock.setblocking(False)
    frame = b"%x\r\n" % piece_bytes + b"x" * piece_bytes + b"\r\n"
    pending, sent = b"", 0
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable:
                break
            if writable:
                if not pending:
                    if sent >= total_bytes:
                        pending = b"0\r\n\r\n"
                    else:
                        pending, sent = frame, sent + piece_bytes
                pending = pending[sock.send(pending) :]
                if sent >= total_bytes and not pending:
                    break
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        return _read_answer(sock, min(sent, total_bytes))
    finally:
        sock.close()


def multipart_csv(csv_bytes: bytes, **fields: str) -> bytes:
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    ]
    parts.append(
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="rows.csv"\r\n'
        "Content-Type: text/csv\r\n\r\n".encode()
        + csv_bytes
        + b"\r\n"
    )
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


# ---------------------------------------------------------------------------------------------
# Bodies
# ---------------------------------------------------------------------------------------------


def test_anonymous_chunked_upload_gets_401_before_its_body_is_read(stack):
    answer = chunked_post(stack.url, "/api/v1/jobs", 64 * MB, {})
    assert answer.status == 401, answer.body
    assert "credentials were not provided" in json.loads(answer.body)["detail"]
    assert answer.sent_bytes < 16 * MB, "the server answered only after most of the body had been sent"
    assert answer.closed, "the server kept the connection open, so it would read the rest of the body"


def test_chunked_upload_with_a_wrong_token_gets_401_before_its_body_is_read(stack):
    answer = chunked_post(stack.url, "/api/v1/jobs", 64 * MB, {"Authorization": "Token not-a-real-token"})
    assert answer.status == 401 and json.loads(answer.body)["detail"] == "invalid token"
    assert answer.sent_bytes < 16 * MB and answer.closed


def test_anonymous_chunked_post_to_the_upload_page_is_sent_to_login_unread(stack):
    answer = chunked_post(stack.url, "/jobs/", 64 * MB, {})
    assert answer.status == 302 and answer.headers["location"].startswith("/accounts/login/?next=/jobs/")
    assert answer.sent_bytes < 16 * MB and answer.closed


def test_authenticated_chunked_upload_past_the_limit_gets_413_early(stack):
    answer = chunked_post(stack.url, "/api/v1/jobs", 64 * MB, {"Authorization": f"Token {stack.token}"})
    assert answer.status == 413, answer.body
    body = json.loads(answer.body)
    assert body["code"] == "payload_too_large" and f"limit is {300000 + MB} bytes" in body["detail"]
    assert answer.sent_bytes < 16 * MB, "the server read far past the limit before answering"
    assert answer.closed


def test_declared_oversized_body_on_any_page_gets_413_unread(stack):
    """Any other URL takes at most DATA_UPLOAD_MAX_MEMORY_SIZE (4 MiB): an anonymous login POST of 50 MB is refused."""
    target = urlparse(stack.url)
    with socket.create_connection((target.hostname, target.port), timeout=10) as sock:
        sock.sendall(
            b"POST /accounts/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 52428800\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\n\r\n" + b"x" * 65536
        )
        answer = _read_answer(sock, 65536)
    assert answer.status == 413 and "the request body is 52428800 bytes" in json.loads(answer.body)["detail"]


def _chunks(data: bytes, size: int) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def _post_chunked(stack, path: str, body: bytes, piece_bytes: int, headers: dict[str, str]) -> tuple[int, str, bytes]:
    """POST a multipart body without Content-Length (http.client frames an iterable as chunked):
    (status, Location header, body)."""
    target = urlparse(stack.url)
    conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
    content_type = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    conn.request("POST", path, body=_chunks(body, piece_bytes), headers={**headers, **content_type})
    response = conn.getresponse()
    answer = response.status, response.getheader("Location") or "", response.read()
    conn.close()
    return answer


def test_legitimate_chunked_upload_within_the_limit_is_accepted(stack):
    rows = 120
    csv_bytes = ("key,text\n" + "".join(f"k{i},where is my parcel {i}\n" for i in range(rows))).encode()
    body = multipart_csv(csv_bytes, model="router", text_column="text", id_column="key")
    status, _, raw = _post_chunked(stack, "/api/v1/jobs", body, 1000, {"Authorization": f"Token {stack.token}"})
    answer = json.loads(raw)
    assert status in (201, 202), answer
    job_url = f"{stack.url}/api/v1/jobs/{answer['id']}"

    def finished():
        job = requests.get(job_url, headers=stack.headers(), timeout=10).json()
        return job if job["status"] in ("succeeded", "partial", "failed", "cancelled") else None

    job = wait_until(finished, 120, "the chunked upload's job to finish")
    assert job["status"] == "succeeded" and job["total_rows"] == rows and job["done_rows"] == rows, job


def test_legitimate_chunked_upload_through_the_web_page_is_accepted(stack):
    browser = stack.browser_login("tester")
    browser.get(f"{stack.url}/jobs/", timeout=10)
    csv_bytes = b"key,text\n" + b"".join(b"k%d,refund for order %d\n" % (i, i) for i in range(30))
    body = multipart_csv(
        csv_bytes,
        csrfmiddlewaretoken=browser.cookies["csrftoken"],
        model="router",
        text_column="text",
        id_column="key",
        encoding="utf-8",
    )
    cookies = "; ".join(f"{name}={value}" for name, value in browser.cookies.items())
    status, location, raw = _post_chunked(stack, "/jobs/", body, 500, {"Cookie": cookies})
    page = raw.decode(errors="replace")
    assert status == 302, page[-2000:]
    assert re.match(r"^/jobs/\d+/$", location), "the page should redirect to the new job"


# ---------------------------------------------------------------------------------------------
# Hosts and /metrics
# ---------------------------------------------------------------------------------------------


def test_predict_with_a_foreign_host_gets_400_like_every_other_path(stack):
    foreign = {**stack.headers(), "Host": "evil.example"}
    predict = requests.post(
        f"{stack.url}/api/v1/models/router/predict", json={"inputs": ["hello"]}, headers=foreign, timeout=10
    )
    assert predict.status_code == 400
    assert predict.json()["code"] == "disallowed_host" and "evil.example" in predict.json()["detail"]
    assert requests.get(f"{stack.url}/api/v1/models", headers=foreign, timeout=10).status_code == 400
    assert stack.predict("router", ["hello"]).status_code == 200, "an allowed host still gets its prediction"


def test_metrics_need_the_token_or_a_staff_session(stack):
    from django.conf import settings

    anonymous = requests.get(f"{stack.url}/metrics", timeout=10)
    assert anonymous.status_code == 401 and "METRICS_TOKEN" in anonymous.text
    wrong = requests.get(f"{stack.url}/metrics", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401
    # The web process and this one read the same METRICS_TOKEN (the environment, or var/metrics_token).
    scraper = requests.get(
        f"{stack.url}/metrics", headers={"Authorization": f"Bearer {settings.METRICS_TOKEN}"}, timeout=10
    )
    assert scraper.status_code == 200 and "inference_requests_total" in scraper.text
    assert stack.browser_login("boss").get(f"{stack.url}/metrics", timeout=10).status_code == 200
    assert stack.browser_login("tester").get(f"{stack.url}/metrics", timeout=10).status_code == 401


# ---------------------------------------------------------------------------------------------
# Failed-authentication throttling, on a second web process with a limit of 3 per 30 s
# ---------------------------------------------------------------------------------------------

FAILURE_LIMIT = 3


@pytest.fixture(scope="module")
def strict_web(stack) -> Iterator[str]:
    """A web process beside the stack's with AUTH_FAILURES_PER_WINDOW=3, on its own Redis database,
    so its failure counters never touch the stack's (all test clients share 127.0.0.1)."""
    redis_url = stack.env["REDIS_URL"].rsplit("/", 1)[0] + "/13"
    env = {**stack.env, "REDIS_URL": redis_url, "AUTH_FAILURES_PER_WINDOW": str(FAILURE_LIMIT)}
    env["AUTH_FAILURE_WINDOW_S"] = "30"
    env["AUTH_ACCOUNT_FAILURES_PER_WINDOW"] = str(FAILURE_LIMIT)
    port = free_port()
    command = [sys.executable, "-m", "platform_.server", "--host", "127.0.0.1", "--port", str(port)]
    web = _start([*command, "--workers", "1", "--no-access-log"], env, stack.log_dir / "strict-web.log")
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert web.poll() is None, (stack.log_dir / "strict-web.log").read_text()[-3000:]
        try:
            return requests.get(f"{url}/api/v1/health", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    try:
        wait_until(up, 60, "the strict web process")
        yield url
    finally:
        _stop(web)


@pytest.fixture
def fresh_failures(stack):
    """Start each throttling test with no failures counted for 127.0.0.1 on the strict process's Redis."""
    import redis

    from platform_ import auth_throttle

    client = redis.Redis.from_url(stack.env["REDIS_URL"].rsplit("/", 1)[0] + "/13")

    def forget() -> None:
        for name in client.scan_iter(f"{auth_throttle.KEY_PREFIX}*"):  # addresses and accounts
            client.delete(name)

    forget()
    yield
    forget()


def _assert_throttled(response: requests.Response) -> None:
    assert response.status_code == 429, response.text
    assert 1 <= int(response.headers["Retry-After"]) <= 30
    assert "too many failed authentication attempts from 127.0.0.1" in response.text


def test_repeated_bad_tokens_on_predict_get_429(stack, strict_web, fresh_failures):
    def predict(token: str) -> requests.Response:
        return requests.post(
            f"{strict_web}/api/v1/models/router/predict",
            json={"inputs": ["hello"]},
            headers={"Authorization": f"Token {token}"},
            timeout=10,
        )

    for _ in range(FAILURE_LIMIT):
        assert predict(secrets.token_hex(20)).status_code == 401
    throttled = predict(secrets.token_hex(20))
    _assert_throttled(throttled)
    assert throttled.json()["code"] == "auth_throttled"
    # A valid token still works from that address: another tenant behind the same NAT is not locked out
    # (a 40-hex-digit token cannot be guessed; what throttling stops is the flood of failed lookups).
    # (past authentication it meets admission: this web process's Redis has no worker, hence no_worker)
    assert predict(stack.token).json()["code"] == "no_worker"


def test_repeated_bad_tokens_on_the_rest_of_the_api_get_429(stack, strict_web, fresh_failures):
    def jobs(token: str) -> requests.Response:
        return requests.get(f"{strict_web}/api/v1/jobs", headers={"Authorization": f"Token {token}"}, timeout=10)

    for _ in range(FAILURE_LIMIT):
        assert jobs(secrets.token_hex(20)).status_code == 401
    throttled = jobs(secrets.token_hex(20))
    _assert_throttled(throttled)
    assert throttled.json()["code"] == "auth_throttled"
    assert jobs(stack.token).status_code == 200, "a valid token is not locked out"
    # The stack's own web process counts in its own Redis: the same address still works there.
    assert requests.get(f"{stack.url}/api/v1/jobs", headers=stack.headers(), timeout=10).status_code == 200


def test_repeated_bad_passwords_at_the_login_form_get_429(strict_web, fresh_failures):
    session = requests.Session()
    login = f"{strict_web}/accounts/login/"

    def attempt(password: str) -> requests.Response:
        session.get(login, timeout=10)
        return session.post(
            login,
            data={"username": "tester", "password": password, "csrfmiddlewaretoken": session.cookies["csrftoken"]},
            headers={"Referer": login},
            timeout=10,
            allow_redirects=False,
        )

    for _ in range(FAILURE_LIMIT):
        failed = attempt("wrong-password")
        assert failed.status_code == 200 and "sessionid" not in session.cookies
    _assert_throttled(attempt("wrong-password"))
    _assert_throttled(attempt(TESTER_PASSWORD))
    assert "sessionid" not in session.cookies
    # The admin's login form counts against the same address.
    admin_login = f"{strict_web}/admin/login/"
    session.get(admin_login, timeout=10)
    admin = session.post(
        admin_login,
        data={"username": "boss", "password": TESTER_PASSWORD, "csrfmiddlewaretoken": session.cookies["csrftoken"]},
        headers={"Referer": admin_login},
        timeout=10,
        allow_redirects=False,
    )
    _assert_throttled(admin)


class _FromAddress(requests.adapters.HTTPAdapter):
    """Connections from one loopback address: another client, as another host would be."""

    def __init__(self, source: str) -> None:
        self.source = source
        super().__init__()

    def init_poolmanager(self, *args, **kwargs) -> None:
        super().init_poolmanager(*args, source_address=(self.source, 0), **kwargs)


def _sign_in(url: str, source: str, username: str, password: str) -> requests.Response:
    session = requests.Session()
    session.mount("http://", _FromAddress(source))
    login = f"{url}/accounts/login/"
    session.get(login, timeout=10)
    return session.post(
        login,
        data={"username": username, "password": password, "csrfmiddlewaretoken": session.cookies["csrftoken"]},
        headers={"Referer": login},
        timeout=10,
        allow_redirects=False,
    )


def test_guesses_at_one_account_from_many_addresses_lock_that_account_only(strict_web, fresh_failures):
    """Per address alone, a guesser rotating addresses was never stopped; per account it is, and other
    accounts (and other users behind the guesser's address) still sign in."""
    for n in range(FAILURE_LIMIT):  # one guess from each address: no address reaches its limit
        assert _sign_in(strict_web, f"127.0.1.{n + 1}", "tester", "wrong-password").status_code == 200
    refused = _sign_in(strict_web, "127.0.1.200", "TESTER", TESTER_PASSWORD)  # case does not dodge it
    assert refused.status_code == 429, refused.text
    assert "too many failed sign-ins to this account" in refused.text
    assert 1 <= int(refused.headers["Retry-After"]) <= 900
    # Another account, from an address that guessed: signs in.
    assert _sign_in(strict_web, "127.0.1.1", "boss", TESTER_PASSWORD).status_code == 302


def test_unicode_variants_of_a_username_share_its_lockout(strict_web, fresh_failures):
    """Django signs "ｔｅｓｔｅｒ" (full width) in as "tester" (NFKC): the variant must not get fresh guesses."""
    for n in range(FAILURE_LIMIT):
        assert _sign_in(strict_web, f"127.0.2.{n + 1}", "tester", "wrong-password").status_code == 200
    for variant in ("ｔｅｓｔｅｒ", "𝗍ester", " Tester "):
        refused = _sign_in(strict_web, "127.0.2.100", variant, TESTER_PASSWORD)
        assert refused.status_code == 429, (variant, refused.status_code)


def test_a_burst_of_concurrent_guesses_is_held_to_the_limit(strict_web, fresh_failures):
    """The limits count an attempt before its password is checked: checked first, then counted, a burst
    of concurrent guesses all passed the check (99 password checks against a limit of 20)."""
    from concurrent.futures import ThreadPoolExecutor

    def guess(n: int) -> int:
        return _sign_in(strict_web, "127.0.3.1", "tester", f"wrong-{n}").status_code

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(guess, range(30)))
    assert statuses.count(200) <= FAILURE_LIMIT, statuses  # 200: the form again, the password was checked
    assert statuses.count(429) >= 30 - FAILURE_LIMIT


def test_a_sign_in_that_succeeds_does_not_count_against_the_limits(strict_web, fresh_failures):
    for _ in range(FAILURE_LIMIT + 2):
        assert _sign_in(strict_web, "127.0.4.1", "tester", TESTER_PASSWORD).status_code == 302
