"""Hostile review, issue 25, on the live stack: OPTIONS on the API docs (a 500 and a traceback per
request), forms with too many fields (an HTML 400 on API paths), HEAD on the probes (405), worker
host names and process ids in tenants' answers, and credentials on Flower's Config tab.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import sys
from pathlib import Path
from urllib.parse import urlencode, urlparse

import pytest
import redis
import requests

from tests.conftest import _start, _stop, free_port, wait_until

pytestmark = pytest.mark.integration

BOUNDARY = "review-25-boundary"


def _sample_paths() -> list[str]:
    """Every path of the URLconf, each parameter filled with a plausible value (a model name, an id)."""
    from django.urls import URLResolver, get_resolver
    from django.urls.resolvers import RoutePattern

    samples = {"int": "1", "str": "router", "path": "1", "slug": "x", "uuid": "00000000-0000-0000-0000-000000000000"}

    def regex_sample(regex: str) -> str:
        # A named group of literal alternatives (the admin's app labels) becomes the first; any other, "1".
        def group(match: re.Match) -> str:
            body = match["body"]
            return body.split("|")[0] if re.fullmatch(r"[\w|-]+", body) else "1"

        text = re.sub(r"\(\?P<\w+>(?P<body>[^()]*)\)", group, regex.lstrip("^").rstrip("$").rstrip("\\Z"))
        return text.replace("\\", "")

    def sample(pattern) -> str:
        if isinstance(pattern, RoutePattern):
            return re.sub(r"<(?:(\w+):)?\w+>", lambda m: samples[m[1] or "str"], str(pattern))
        return regex_sample(str(pattern))

    paths: set[str] = set()

    def walk(patterns, prefix: str) -> None:
        for entry in patterns:
            here = prefix + sample(entry.pattern)
            if isinstance(entry, URLResolver):
                walk(entry.url_patterns, here)
            else:
                paths.add("/" + here)

    walk(get_resolver().url_patterns, "")
    return sorted(paths)


def _is_api(path: str) -> bool:
    return path.startswith(("/api/", "/v1/"))


@pytest.fixture(scope="module")
def callers(stack, django_db_blocker) -> dict[str, requests.Session]:
    """Anonymous, a tenant with a token, and a staff member logged in through the form."""
    token = requests.Session()
    token.headers["Authorization"] = f"Token {stack.token}"
    return {"anonymous": requests.Session(), "token": token, "staff": stack.browser_login("boss")}


def _log_size(stack) -> int:
    return (stack.log_dir / "web.log").stat().st_size


def _log_since(stack, offset: int) -> str:
    with (stack.log_dir / "web.log").open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


# ---------------------------------------------------------------------------------------------
# 1. OPTIONS on the docs, and on every path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/api/docs/", "/api/redoc/", "/api/schema/"])
def test_options_on_the_api_docs_answers_json_and_logs_no_traceback(stack, path):
    before = _log_size(stack)
    answer = requests.options(f"{stack.url}{path}", timeout=10)
    assert answer.status_code == 200, answer.text[:2000]
    assert answer.headers["Content-Type"] == "application/json"
    assert "GET" in answer.headers["Allow"] and "name" in answer.json()
    log = _log_since(stack, before)
    assert "Traceback" not in log and "TemplateDoesNotExist" not in log, log[-3000:]


def test_errors_on_the_api_docs_are_the_apis_json_not_a_page(stack):
    refused = requests.get(f"{stack.url}/api/docs/", headers={"Authorization": "Token not-a-token"}, timeout=10)
    assert refused.status_code == 401 and refused.json()["code"] == "authentication_failed"
    posted = requests.post(f"{stack.url}/api/redoc/", timeout=10)
    assert posted.status_code == 405 and posted.json()["code"] == "method_not_allowed"
    schema = requests.put(f"{stack.url}/api/schema/", timeout=10)
    assert schema.status_code == 405 and schema.json()["code"] == "method_not_allowed"
    # The pages themselves are unchanged.
    assert "swagger-ui" in requests.get(f"{stack.url}/api/docs/", timeout=10).text
    assert "openapi" in requests.get(f"{stack.url}/api/schema/", timeout=10).text


@pytest.mark.parametrize("caller", ["anonymous", "token", "staff"])
def test_options_on_every_path_answers_without_a_server_error(stack, callers, caller):
    session = callers[caller]
    failures = []
    for path in _sample_paths():
        answer = session.options(f"{stack.url}{path}", timeout=10, allow_redirects=False)
        if answer.status_code >= 500:
            failures.append(f"{path}: {answer.status_code} {answer.text[:200]}")
        elif _is_api(path) and answer.content and "json" not in answer.headers.get("Content-Type", ""):
            failures.append(f"{path}: {answer.status_code} {answer.headers.get('Content-Type')} {answer.text[:200]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("caller", ["anonymous", "token", "staff"])
def test_head_answers_like_get_on_every_api_path(stack, callers, caller):
    session = callers[caller]
    differ = []
    for path in [p for p in _sample_paths() if _is_api(p)]:
        get = session.get(f"{stack.url}{path}", timeout=10, allow_redirects=False)
        head = session.head(f"{stack.url}{path}", timeout=10, allow_redirects=False)
        if head.status_code != get.status_code:
            differ.append(f"{path}: GET {get.status_code}, HEAD {head.status_code} {head.headers.get('Allow')}")
    assert not differ, "\n".join(differ)


# ---------------------------------------------------------------------------------------------
# 2. Forms with too many fields or files
# ---------------------------------------------------------------------------------------------

FIELDS = 10_000


def _multipart(fields: int = 0, files: int = 0) -> bytes:
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\nx\r\n'.encode() for i in range(fields)
    ]
    parts += [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file{i}"; filename="f{i}.csv"\r\n'
        f"Content-Type: text/csv\r\n\r\ntext\nhello\r\n".encode()
        for i in range(files)
    ]
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def test_a_form_with_too_many_fields_gets_a_json_400_naming_the_problem(stack):
    before = _log_size(stack)
    flood = urlencode({f"f{i}": "x" for i in range(FIELDS)})
    urlencoded = requests.post(
        f"{stack.url}/api/v1/jobs",
        data=flood,
        headers=stack.headers(**{"Content-Type": "application/x-www-form-urlencoded"}),
        timeout=30,
    )
    multipart = requests.post(
        f"{stack.url}/api/v1/jobs",
        data=_multipart(fields=FIELDS),
        headers=stack.headers(**{"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}),
        timeout=30,
    )
    query = requests.get(
        f"{stack.url}/api/v1/jobs?{urlencode({f'q{i}': 1 for i in range(1001)})}", headers=stack.headers(), timeout=10
    )
    for answer in (urlencoded, multipart, query):
        assert answer.status_code == 400, answer.text[:500]
        assert answer.json() == {
            "detail": "the form or query string has more than 1000 fields",
            "code": "too_many_fields",
        }
    # Logged as one line each, without Django's traceback (a flood of these would otherwise fill the log).
    log = _log_since(stack, before)
    assert log.count("TooManyFieldsSent") == 3 and "Traceback" not in log, log[-3000:]


def test_a_form_with_too_many_files_gets_a_json_400_naming_the_problem(stack):
    answer = requests.post(
        f"{stack.url}/api/v1/jobs",
        data=_multipart(files=150),
        headers=stack.headers(**{"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}),
        timeout=30,
    )
    assert answer.status_code == 400, answer.text[:500]
    assert answer.json() == {"detail": "the form has more than 100 files", "code": "too_many_files"}


def test_a_page_form_with_too_many_fields_gets_the_styled_400_page(stack):
    session = requests.Session()
    login = f"{stack.url}/accounts/login/"
    session.get(login, timeout=10)
    fields = {"csrfmiddlewaretoken": session.cookies["csrftoken"], **{f"f{i}": "x" for i in range(FIELDS)}}
    answer = session.post(login, data=fields, headers={"Referer": login}, timeout=30)
    assert answer.status_code == 400
    assert answer.headers["Content-Type"].startswith("text/html")
    assert "This request could not be read" in answer.text and 'href="/jobs/"' in answer.text


def test_the_400_handler_answers_data_too_big_as_413_json_on_api_paths(rf):
    """Not reachable on the test stack: BodyGuard refuses any body past DATA_UPLOAD_MAX_MEMORY_SIZE
    first, except an upload within JOBS_MAX_UPLOAD_BYTES whose fields alone pass it (4 MiB, larger
    than the tests' whole upload limit)."""
    from django.core.exceptions import RequestDataTooBig

    from platform_.errors import json_400

    api = json_400(rf.post("/api/v1/jobs"), RequestDataTooBig("too big"))
    assert api.status_code == 413 and json.loads(api.content)["code"] == "payload_too_large"
    openai = json.loads(json_400(rf.post("/v1/files"), RequestDataTooBig("too big")).content)
    assert openai["error"]["code"] == "payload_too_large" and "4194304 bytes" in openai["error"]["message"]


# ---------------------------------------------------------------------------------------------
# 3. HEAD on the probes and model lists
# ---------------------------------------------------------------------------------------------


def _raw_head(stack, path: str, authorization: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """HEAD over a raw socket, read to the server's close: (status, headers, whatever followed the headers)."""
    target = urlparse(stack.url)
    lines = [f"HEAD {path} HTTP/1.1", f"Host: {target.hostname}", "Connection: close"]
    if authorization:
        lines.append(f"Authorization: {authorization}")
    with socket.create_connection((target.hostname, target.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        while piece := sock.recv(65536):
            data += piece
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *fields = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (f.split(":", 1) for f in fields)}
    return int(status_line.split()[1]), headers, rest


@pytest.mark.parametrize(
    "path, authenticated",
    [("/api/v1/health", False), ("/api/v1/ready", False), ("/api/v1/models", True), ("/v1/models", True)],
)
def test_head_answers_like_get_without_a_body(stack, path, authenticated):
    authorization = f"Token {stack.token}" if authenticated else None
    status, headers, body = _raw_head(stack, path, authorization)
    get = requests.get(
        f"{stack.url}{path}", headers={"Authorization": authorization} if authorization else {}, timeout=10
    )
    assert (status, get.status_code) == (200, 200), headers
    assert headers["content-type"] == "application/json" and body == b""


# ---------------------------------------------------------------------------------------------
# 4. Which worker answered: staff only
# ---------------------------------------------------------------------------------------------


def test_predict_names_the_worker_that_answered_to_staff_only(stack, django_db_blocker):
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    with django_db_blocker.unblock():
        staff_token = Token.objects.get_or_create(user=get_user_model().objects.get(username="boss"))[0].key
    tenant = stack.predict("router", ["where is my parcel"])
    assert tenant.status_code == 200, tenant.text
    assert set(tenant.json()) == {"model", "model_version", "outputs", "timing"}
    staff = stack.predict("router", ["where is my parcel"], token=staff_token)
    assert staff.status_code == 200, staff.text
    host, _, pid = staff.json()["worker"].rpartition(":")
    assert host == socket.gethostname() and pid.isdigit()


# ---------------------------------------------------------------------------------------------
# 5. Flower's Config tab: a worker whose REDIS_URL carries a password
# ---------------------------------------------------------------------------------------------


def test_flowers_worker_page_masks_the_redis_password(stack, redis_url, tmp_path):
    password = secrets.token_hex(8)
    host_port = urlparse(redis_url).netloc
    # Its own database: the stack's workers neither answer its broadcasts nor take its queue. The test
    # Redis has no password, and takes any for the default user.
    own_db = f"redis://:{password}@{host_port}/14"
    redis.Redis.from_url(own_db).flushdb()
    env = {k: v for k, v in stack.env.items() if k not in ("WORKER_QUEUE", "WORKER_MODELS")}
    env["REDIS_URL"] = own_db
    bin_dir = Path(sys.executable).parent
    name = f"conf-{os.getpid()}@review25"
    command = [str(bin_dir / "celery"), "-A", "platform_", "worker", "-Q", "online.identity", "-c", "1"]
    worker = _start([*command, "--without-mingle", "-n", name], env, tmp_path / "worker.log")
    port = free_port()
    flower_auth = ("ops", secrets.token_hex(8))
    flower_command = [str(bin_dir / "celery"), "-A", "platform_", "flower", "--address=127.0.0.1", f"--port={port}"]
    flower = _start([*flower_command, f"--basic-auth={':'.join(flower_auth)}"], env, tmp_path / "flower.log")

    def worker_page() -> requests.Response | None:
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
        assert flower.poll() is None, (tmp_path / "flower.log").read_text()[-3000:]
        try:
            page = requests.get(f"http://127.0.0.1:{port}/worker/{name}", auth=flower_auth, timeout=10)
        except requests.ConnectionError:
            return None
        return page if page.status_code == 200 and "REDIS_URL" in page.text else None

    try:
        page = wait_until(worker_page, 90, "Flower's page of the worker, with its configuration", interval_s=0.5)
    finally:
        _stop(flower)
        _stop(worker)
        redis.Redis.from_url(own_db).flushdb()
    assert password not in page.text
    # REDIS_URL, CACHES' LOCATION, the broker and the result backend are all shown, masked.
    assert page.text.count(f"redis://:********@{host_port}/14") >= 3, page.text
