"""Job callbacks: a signed POST of the job's summary when it ends, retried, recorded on the job row.

In-process tests call the plain functions (check_destination, attempt) and the secret API; the live
tests run jobs on the stack (tests/conftest.py: JOBS_CALLBACK_ALLOW_PRIVATE on, 0.2 s backoff) and
receive their callbacks on a real HTTP server on 127.0.0.1, verifying signatures with the secret the
API returned.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import callbacks
from jobs.api.serializers import JobCreateSerializer
from jobs.callbacks import CallbackRefused, Unresolvable, check_destination
from jobs.models import CallbackSecret, CallbackStatus, Job, JobStatus
from tests.conftest import free_port, wait_until
from tests.jobs.factories import job_with_rows, user
from tests.jobs.test_jobs_api import get_job, make_csv, upload, wait_for_end


def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """What a receiver does (docs/api.md, "Job callbacks"): recompute the HMAC and compare in constant time."""
    timestamp = headers["X-Timestamp"]
    expected = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(f"sha256={expected}", headers["X-Signature-256"])


# A local receiver -----------------------------------------------------------------------------


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """An HTTP server on 127.0.0.1 that answers POSTs with the statuses given, in turn (then the last one)."""

    statuses: list[int]
    got: list[Received] = field(default_factory=list)
    extra_headers: dict[str, str] = field(default_factory=dict)
    url: str = ""

    def answer(self) -> int:
        return self.statuses[min(len(self.got) - 1, len(self.statuses) - 1)]


@pytest.fixture
def receiver() -> Iterator[callable]:
    servers: list[ThreadingHTTPServer] = []

    def start(*statuses: int, tls: ssl.SSLContext | None = None, **extra_headers: str) -> Receiver:
        state = Receiver(list(statuses), extra_headers=extra_headers)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                state.got.append(Received(dict(self.headers.items()), body))
                self.send_response(state.answer())
                for name, value in state.extra_headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls:
            server.socket = tls.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        scheme = "https" if tls else "http"
        state.url = f"{scheme}://127.0.0.1:{server.server_address[1]}/hooks/jobs?source=tests"
        return state

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


# Destinations -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000/hook",
        "http://localhost/hook",
        "http://10.0.0.5/hook",
        "http://192.168.1.1/hook",
        "http://169.254.169.254/latest/meta-data",  # a cloud metadata service
        "http://[::1]/hook",
        "http://[::ffff:127.0.0.1]/hook",
        "http://0.0.0.0/hook",
    ],
)
def test_private_loopback_and_link_local_destinations_are_refused(url):
    with pytest.raises(CallbackRefused, match="public addresses only"):
        check_destination(url, allow_private=False)
    assert check_destination(url, allow_private=True)


@pytest.mark.parametrize("url", ["ftp://example.com/x", "file:///etc/passwd", "http:///nohost"])
def test_only_http_urls_with_a_host_are_accepted(url):
    with pytest.raises(CallbackRefused):
        check_destination(url, allow_private=True)


def test_a_url_with_a_user_name_or_password_is_refused():
    # Never sent (the signature authenticates), yet it would be stored and shown to staff.
    with pytest.raises(CallbackRefused, match="user name or password"):
        check_destination("https://hook:s3cret@93.184.215.14/hooks", allow_private=False)


def test_an_internationalised_host_goes_in_the_host_header_as_idna(receiver, monkeypatch):
    hook = receiver(200)
    port = hook.url.split(":")[2].split("/")[0]
    # No resolver here knows bücher.example: the name's check answers the receiver's address, and what
    # is tested is the Host header the receiver got (http.client refuses a non-ASCII one).
    monkeypatch.setattr(callbacks, "check_destination", lambda url, allow_private: ["127.0.0.1"])
    answer = callbacks.post(f"http://bücher.example:{port}/hooks", b"{}", {}, timeout_s=5.0, allow_private=True)
    assert answer.status == 200, answer
    assert hook.got[0].headers["Host"] == f"xn--bcher-kva.example:{port}"


def test_a_public_address_is_accepted():
    assert check_destination("https://93.184.215.14/hooks", allow_private=False) == ["93.184.215.14"]


@pytest.mark.django_db
def test_the_job_form_refuses_a_private_callback_url_with_its_reason(settings):
    settings.JOBS_CALLBACK_ALLOW_PRIVATE = False
    form = JobCreateSerializer(
        data={"file": _csv_file(), "model": "router", "callback_url": "http://169.254.169.254/latest"}
    )
    assert not form.is_valid()
    assert "public addresses only" in str(form.errors["callback_url"])


@pytest.mark.django_db
def test_creating_a_job_with_a_private_callback_url_is_a_400(settings):
    settings.JOBS_CALLBACK_ALLOW_PRIVATE = False
    client = APIClient()
    client.force_authenticate(user("hooker"))
    response = client.post(
        "/api/v1/jobs",
        {"file": _csv_file(), "model": "router", "text_column": "text", "callback_url": "http://127.0.0.1:9/x"},
        format="multipart",
    )
    assert response.status_code == 400, response.content
    assert "public addresses only" in json.dumps(response.json())
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_a_callback_url_before_the_user_has_a_secret_is_a_400_that_says_how_to_get_one(settings):
    settings.JOBS_CALLBACK_ALLOW_PRIVATE = True
    client = APIClient()
    client.force_authenticate(user("newcomer"))
    form = {"file": _csv_file(), "model": "router", "text_column": "text", "callback_url": "http://127.0.0.1:9/x"}
    response = client.post("/api/v1/jobs", form, format="multipart")
    assert response.status_code == 400, response.content
    assert "POST /api/v1/callback-secret" in json.dumps(response.json())
    assert not Job.objects.exists()
    assert client.post("/api/v1/callback-secret").status_code == 201
    form["file"] = _csv_file()
    assert client.post("/api/v1/jobs", form, format="multipart").status_code == 202


def _csv_file() -> io.BytesIO:
    data = io.BytesIO(make_csv(3))
    data.name = "rows.csv"
    return data


# One attempt, in process --------------------------------------------------------------------


def test_outcomes_by_status():
    outcome, answer = callbacks.outcome_of, callbacks.Answer
    assert outcome(answer(200)) is outcome(answer(204)) is callbacks.Outcome.DELIVERED
    for retried in (None, 408, 429, 500, 502, 503):
        assert outcome(answer(retried, "x")) is callbacks.Outcome.RETRY, retried
    for final in (301, 302, 400, 401, 403, 404, 410, 422):
        assert outcome(answer(final)) is callbacks.Outcome.GIVE_UP, final
    assert [callbacks.retry_delay_s(n, 30) for n in (1, 2, 3, 4, 5)] == [30, 60, 120, 240, 480]


@pytest.fixture
def ended_job(db, settings):
    """A succeeded job whose callback is due (as Job._ended leaves it), to the URL set by the test."""
    settings.JOBS_CALLBACK_ALLOW_PRIVATE = True
    settings.JOBS_CALLBACK_ATTEMPTS = 3
    settings.JOBS_CALLBACK_BACKOFF_S = 30.0

    owner = user("owner")

    def make(url: str) -> Job:
        job = job_with_rows(owner)
        Job.objects.filter(pk=job.pk).update(
            finished_at=timezone.now(), callback_url=url, callback_status=CallbackStatus.PENDING
        )
        return Job.objects.get(pk=job.pk)

    return make


def test_an_attempt_posts_the_signed_summary_and_records_delivery(ended_job, receiver):
    hook = receiver(200)
    job = ended_job(hook.url)
    assert callbacks.attempt(job.pk, job.finished_at.isoformat(), 1) is None
    [got] = hook.got
    secret = CallbackSecret.objects.get(owner=job.owner).secret  # made at first use: the owner had none
    assert verify(secret, got.headers, got.body)
    body = json.loads(got.body)
    assert body["id"] == job.pk and body["status"] == "succeeded" and body["done_rows"] == 4
    assert body["links"]["results_csv"] == f"/api/v1/jobs/{job.pk}/results.csv"  # JOBS_CALLBACK_BASE_URL unset
    job.refresh_from_db()
    assert (job.callback_status, job.callback_attempts, job.callback_last_status) == ("delivered", 1, 200)
    assert job.callback_last_at is not None


def test_links_are_absolute_under_the_base_url(ended_job, receiver, settings):
    settings.JOBS_CALLBACK_BASE_URL = "https://jobs.example.com/"
    job = ended_job("http://127.0.0.1:9/")
    links = callbacks.payload(job)["links"]
    assert links["results"] == f"https://jobs.example.com/api/v1/jobs/{job.pk}/results"


def test_a_5xx_is_retried_a_410_is_final_and_a_redirect_is_not_followed(ended_job, receiver):
    flaky = ended_job(receiver(503).url)
    assert callbacks.attempt(flaky.pk, flaky.finished_at.isoformat(), 1) == 30.0  # JOBS_CALLBACK_BACKOFF_S
    flaky.refresh_from_db()
    assert (flaky.callback_status, flaky.callback_last_status) == ("pending", 503)

    gone = receiver(410)
    job = ended_job(gone.url)
    assert callbacks.attempt(job.pk, job.finished_at.isoformat(), 1) is None
    job.refresh_from_db()
    assert (job.callback_status, job.callback_attempts, job.callback_last_status) == ("failed", 1, 410)

    moved = receiver(302, Location="http://169.254.169.254/latest")
    job = ended_job(moved.url)
    assert callbacks.attempt(job.pk, job.finished_at.isoformat(), 1) is None
    job.refresh_from_db()
    assert job.callback_status == "failed" and "not followed" in job.callback_last_error
    assert len(moved.got) == 1


def test_the_last_attempt_gives_up_and_a_refused_connection_is_recorded(ended_job):
    job = ended_job(f"http://127.0.0.1:{free_port()}/")  # nothing listens there
    assert callbacks.attempt(job.pk, job.finished_at.isoformat(), 1) == 30.0
    job.refresh_from_db()
    assert job.callback_last_status is None and "ConnectionRefusedError" in job.callback_last_error
    assert callbacks.attempt(job.pk, job.finished_at.isoformat(), 2) == 60.0
    assert callbacks.attempt(job.pk, job.finished_at.isoformat(), 3) is None  # JOBS_CALLBACK_ATTEMPTS = 3
    job.refresh_from_db()
    assert (job.callback_status, job.callback_attempts) == ("failed", 3)


def test_a_duplicate_or_stale_message_sends_nothing(ended_job, receiver):
    hook = receiver(200)
    job = ended_job(hook.url)
    ended_at = job.finished_at.isoformat()
    callbacks.attempt(job.pk, ended_at, 1)
    assert callbacks.attempt(job.pk, ended_at, 1) is None  # redelivered: attempt 1 is claimed already
    earlier_end = (job.finished_at - timedelta(hours=1)).isoformat()
    Job.objects.filter(pk=job.pk).update(callback_status=CallbackStatus.PENDING, callback_attempts=0)
    assert callbacks.attempt(job.pk, earlier_end, 1) is None  # for an end the job has since left
    assert len(hook.got) == 1


@pytest.fixture
def certificate(tmp_path) -> tuple[str, ssl.SSLContext]:
    """A self-signed certificate for `localhost` (only), and a server context serving it."""
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    return str(cert), server


def test_https_goes_to_the_checked_address_and_verifies_the_url_host(ended_job, receiver, certificate, monkeypatch):
    cert, server_context = certificate
    hook = receiver(200, tls=server_context)
    by_name = hook.url.replace("127.0.0.1", "localhost")

    job = ended_job(by_name)  # the system's CAs do not know this certificate: no delivery, a retry
    assert callbacks.attempt(job.pk, job.finished_at.isoformat(), 1) == 30.0
    job.refresh_from_db()
    assert "CERTIFICATE_VERIFY_FAILED" in job.callback_last_error and hook.got == []

    trusting = ssl.create_default_context(cafile=cert)
    monkeypatch.setattr(callbacks.ssl, "create_default_context", lambda: trusting)
    job = ended_job(by_name)  # connected to 127.0.0.1, the certificate checked for `localhost`
    assert callbacks.attempt(job.pk, job.finished_at.isoformat(), 1) is None
    job.refresh_from_db()
    assert (job.callback_status, job.callback_last_status) == ("delivered", 200)
    assert hook.got[0].headers["Host"] == by_name.split("/")[2]

    job = ended_job(hook.url)  # by address: the certificate names only `localhost`
    callbacks.attempt(job.pk, job.finished_at.isoformat(), 1)
    job.refresh_from_db()
    assert "CERTIFICATE_VERIFY_FAILED" in job.callback_last_error and len(hook.got) == 1


def test_a_destination_that_became_private_is_refused_before_connecting(ended_job, receiver, settings):
    hook = receiver(200)
    job = ended_job(hook.url)
    settings.JOBS_CALLBACK_ALLOW_PRIVATE = False  # as if the host now resolved to a private address
    assert callbacks.attempt(job.pk, job.finished_at.isoformat(), 1) is None
    job.refresh_from_db()
    assert job.callback_status == "failed" and "public addresses only" in job.callback_last_error
    assert hook.got == []


def test_an_unresolvable_host_is_retried(monkeypatch):
    def no_dns(*args, **kwargs):
        raise callbacks.socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(callbacks.socket, "getaddrinfo", no_dns)
    with pytest.raises(Unresolvable):
        check_destination("https://hooks.example.com/x", allow_private=False)


def test_a_job_end_sends_one_callback_and_only_the_winning_transition_does(
    db, monkeypatch, django_capture_on_commit_callbacks
):
    sent = []
    monkeypatch.setattr("jobs.enqueue.callback_attempt", lambda *args, **kwargs: sent.append((*args, kwargs)))
    job = job_with_rows(user("ender"), status=JobStatus.RUNNING)
    Job.objects.filter(pk=job.pk).update(callback_url="https://hooks.example.com/x")
    job.refresh_from_db()
    with django_capture_on_commit_callbacks(execute=True):
        assert job.finish()
        assert not Job.objects.get(pk=job.pk).finish()  # lost the race: already ended
        assert not job.cancel()
    job.refresh_from_db()
    assert job.callback_status == "pending" and job.callback_attempts == 0
    assert sent == [(job.pk, job.finished_at.isoformat(), {"attempt": 1})]


def test_a_job_without_callback_url_sends_nothing(db, monkeypatch, django_capture_on_commit_callbacks):
    sent = []
    monkeypatch.setattr("jobs.enqueue.callback_attempt", lambda *args, **kwargs: sent.append(args))
    job = job_with_rows(user("quiet"), status=JobStatus.RUNNING)
    with django_capture_on_commit_callbacks(execute=True):
        assert job.fail("the file is unusable")
    job.refresh_from_db()
    assert sent == [] and job.callback_status == ""


def test_the_reconciler_resends_a_lost_attempt_once_it_is_overdue(ended_job, monkeypatch, settings):
    sent = []
    monkeypatch.setattr("jobs.enqueue.callback_attempt", lambda *args: sent.append(args))
    settings.JOBS_CALLBACK_TIMEOUT_S, settings.JOBS_CALLBACK_BACKOFF_S = 10.0, 30.0
    now = timezone.now()
    never_sent = ended_job("https://hooks.example.com/a")  # died between the job's end and the send
    Job.objects.filter(pk=never_sent.pk).update(finished_at=now - timedelta(seconds=200))
    # Attempt 1 claimed 40 s ago: overdue 3 x 10 s (its longest run) + 30 s (its backoff) + 60 s (stall) after.
    retry_due = ended_job("https://hooks.example.com/b")
    Job.objects.filter(pk=retry_due.pk).update(callback_attempts=1, callback_last_at=now - timedelta(seconds=40))
    waiting = ended_job("https://hooks.example.com/c")  # attempt 2 just made: its retry is not due yet
    Job.objects.filter(pk=waiting.pk).update(callback_attempts=2, callback_last_at=now - timedelta(seconds=5))
    last_lost = ended_job("https://hooks.example.com/d")  # the last attempt (3) died with its worker
    Job.objects.filter(pk=last_lost.pk).update(callback_attempts=3, callback_last_at=now - timedelta(hours=1))

    assert callbacks.resend_lost(now, stall_s=60) == 1
    # Its message may be only waiting (the worker busy): not sent again on every tick, once per interval.
    assert callbacks.resend_lost(now + timedelta(seconds=30), stall_s=60) == 0
    never_sent.refresh_from_db()
    assert sent == [(never_sent.pk, never_sent.finished_at.isoformat(), 1)]
    later = now + timedelta(seconds=90)
    assert callbacks.resend_lost(later, stall_s=60) == 2  # the first again (nothing claimed it), and attempt 2
    assert (retry_due.pk, retry_due.finished_at.isoformat(), 2) in sent and len(sent) == 3
    last_lost.refresh_from_db()
    assert last_lost.callback_status == "failed" and "lost" in last_lost.callback_last_error


def test_a_resent_attempt_that_meets_the_original_posts_once(ended_job, receiver):
    hook = receiver(200)
    job = ended_job(hook.url)
    ended_at = job.finished_at.isoformat()
    assert callbacks.attempt(job.pk, ended_at, 1) is None
    assert callbacks.attempt(job.pk, ended_at, 1) is None  # the reconciler's copy of attempt 1
    assert len(hook.got) == 1


@pytest.fixture
def trickler() -> Iterator[tuple[str, threading.Event]]:
    """A receiver that accepts, then sends its answer a byte every 0.2 s until released: each read
    succeeds within any socket timeout, so only a deadline on the whole attempt ends it."""
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            try:
                while not release.wait(0.2):
                    self.wfile.write(b"H")
                    self.wfile.flush()
            except OSError:
                pass  # the platform hung up

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", release
    release.set()
    server.shutdown()
    server.server_close()


def test_a_receiver_trickling_its_answer_is_cut_at_the_attempts_deadline(trickler):
    url, _ = trickler
    started = time.monotonic()
    answer = callbacks.post(url, b"{}", {}, timeout_s=1.0, allow_private=True)
    elapsed_s = time.monotonic() - started
    assert answer.status is None and "within the attempt's 1 s" in answer.error, answer
    assert elapsed_s < 3, f"the attempt took {elapsed_s:.1f} s"


# The secret API -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_secret_is_shown_once_and_rotation_replaces_it():
    client = APIClient()
    owner = user("keeper")
    client.force_authenticate(owner)
    assert client.get("/api/v1/callback-secret").json() == {"exists": False, "created_at": None}

    first = client.post("/api/v1/callback-secret")
    assert first.status_code == 201 and len(first.json()["secret"]) >= 40
    described = client.get("/api/v1/callback-secret")
    assert described.status_code == 200
    assert described.json()["exists"] is True and "secret" not in described.json()
    assert first.json()["secret"] not in described.content.decode()

    second = client.post("/api/v1/callback-secret").json()["secret"]
    assert second != first.json()["secret"]
    assert CallbackSecret.objects.get(owner=owner).secret == second
    body = b'{"id":1}'
    assert callbacks.sign(second, 1, body) != callbacks.sign(first.json()["secret"], 1, body)

    anonymous = APIClient().post("/api/v1/callback-secret")
    assert anonymous.status_code in (401, 403)


@pytest.mark.django_db
def test_the_admin_shows_who_has_a_secret_but_never_the_value(admin_client):
    owner = user("shown")
    secret = callbacks.rotate_secret(owner)
    page = admin_client.get(f"/admin/jobs/callbacksecret/{secret.pk}/change/")
    assert page.status_code == 200 and "shown" in page.content.decode()
    assert secret.secret not in page.content.decode()
    listing = admin_client.get("/admin/jobs/callbacksecret/")
    assert secret.secret not in listing.content.decode()


# On the live stack --------------------------------------------------------------------------


def _new_secret(stack) -> str:
    response = requests.post(f"{stack.url}/api/v1/callback-secret", headers=_auth(stack), timeout=10)
    assert response.status_code == 201, response.text
    return response.json()["secret"]


def _auth(stack) -> dict[str, str]:
    return {"Authorization": f"Token {stack.third_token}"}


def _run_job(stack, hook: Receiver, rows: int = 20) -> int:
    response = upload(stack, make_csv(rows), token=stack.third_token, callback_url=hook.url)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _callback_settled(stack, job_id: int) -> dict:
    return wait_until(
        lambda: (
            (job := get_job(stack, job_id, token=stack.third_token))["callback_status"] in ("delivered", "failed")
            and job
        ),
        120,
        f"job {job_id}'s callback to be delivered or to fail",
    )


@pytest.mark.integration
def test_a_job_that_ends_calls_back_signed_once(stack, receiver):
    secret = _new_secret(stack)
    hook = receiver(200)
    job_id = _run_job(stack, hook)
    job = _callback_settled(stack, job_id)
    assert job["status"] == "succeeded"
    assert (job["callback_status"], job["callback_attempts"], job["callback_last_status"]) == ("delivered", 1, 200)
    [got] = hook.got
    assert verify(secret, got.headers, got.body), "the signature verifies with the secret the API returned"
    assert got.headers["Content-Type"] == "application/json"
    assert got.headers["X-Job-Id"] == str(job_id) and got.headers["X-Callback-Attempt"] == "1"
    body = json.loads(got.body)
    assert body["event"] == "job.ended" and body["id"] == job_id and body["status"] == "succeeded"
    assert (body["total_rows"], body["done_rows"], body["failed_rows"]) == (20, 20, 0)
    csv_path = body["links"]["results_csv"]
    export = requests.get(f"{stack.url}{csv_path}", headers=_auth(stack), timeout=30)
    assert export.status_code == 200 and len(export.text.splitlines()) == 21
    print("received callback:", json.dumps({"headers": got.headers, "body": body}, indent=1))


@pytest.mark.integration
def test_a_receiver_failing_twice_gets_it_on_the_third_attempt(stack, receiver):
    secret = _new_secret(stack)
    hook = receiver(500, 500, 200)
    job_id = _run_job(stack, hook)
    job = _callback_settled(stack, job_id)
    assert (job["callback_status"], job["callback_attempts"], job["callback_last_status"]) == ("delivered", 3, 200)
    assert len(hook.got) == 3
    assert [g.headers["X-Callback-Attempt"] for g in hook.got] == ["1", "2", "3"]
    assert len({g.body for g in hook.got}) == 1, "every attempt carries the same body"
    assert all(verify(secret, g.headers, g.body) for g in hook.got)


@pytest.mark.integration
def test_a_410_fails_the_callback_without_retrying(stack, receiver):
    hook = receiver(410)
    job_id = _run_job(stack, hook)
    job = _callback_settled(stack, job_id)
    assert (job["callback_status"], job["callback_attempts"], job["callback_last_status"]) == ("failed", 1, 410)
    assert len(hook.got) == 1


@pytest.mark.integration
def test_a_cancelled_job_calls_back_and_rotation_changes_the_signature(stack, receiver):
    old = _new_secret(stack)
    new = _new_secret(stack)
    hook = receiver(200)
    job_id = _run_job(stack, hook, rows=4000)
    cancelled = requests.post(f"{stack.url}/api/v1/jobs/{job_id}/cancel", headers=_auth(stack), timeout=10)
    assert cancelled.status_code == 200, cancelled.text
    _callback_settled(stack, job_id)
    [got] = hook.got
    assert json.loads(got.body)["status"] == "cancelled"
    assert verify(new, got.headers, got.body) and not verify(old, got.headers, got.body)


@pytest.mark.integration
def test_a_slow_receiver_does_not_hold_up_another_users_job(stack, trickler):
    """One user's callback goes to a receiver that never finishes answering (cut at the attempt's 10 s
    deadline). The POST runs on a thread of the offline child, so another user's job, uploaded while
    it hangs, runs and ends meanwhile."""
    url, release = trickler
    _new_secret(stack)
    slow = upload(stack, make_csv(5), token=stack.third_token, callback_url=url)
    assert slow.status_code == 202, slow.text
    wait_until(
        lambda: get_job(stack, slow.json()["id"], token=stack.third_token)["callback_attempts"] >= 1,
        60,
        "the slow callback's first attempt to start",
    )
    started = time.monotonic()
    other = upload(stack, make_csv(20))  # the stack's first user
    assert other.status_code == 202, other.text
    job = wait_for_end(stack, other.json()["id"])
    assert job["status"] == "succeeded"
    assert not release.is_set()
    assert time.monotonic() - started < 9, "the other job waited for the slow receiver's attempt"


@pytest.mark.integration
def test_a_callback_does_not_wait_behind_another_jobs_queued_chunks(stack, receiver):
    """A job ends (cancelled) while another job's 100 chunks wait on `offline`: its callback, on its own
    queue, arrives while the big job has barely started. On `offline` it would be taken only after the
    big job's chunks, which the worker takes a few at a time, with most of the big job done."""
    big = upload(stack, make_csv(5000), token=stack.third_token)
    assert big.status_code == 202, big.text
    big_id = big.json()["id"]
    wait_until(
        lambda: get_job(stack, big_id, token=stack.third_token)["status"] in ("queued", "running"),
        120,
        "the big job's chunks to be queued",
    )
    hook = receiver(200)
    small = _run_job(stack, hook, rows=20)  # its ingest waits behind the big job's chunks
    cancelled = requests.post(f"{stack.url}/api/v1/jobs/{small}/cancel", headers=_auth(stack), timeout=10)
    assert cancelled.status_code == 200, cancelled.text
    _callback_settled(stack, small)
    big_job = get_job(stack, big_id, token=stack.third_token)
    assert len(hook.got) == 1
    finished = big_job["done_rows"] + big_job["failed_rows"]
    assert finished < big_job["total_rows"] / 2, f"the callback waited for {finished} of the big job's rows"
