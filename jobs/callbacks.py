"""Job callbacks: where a job's summary may be POSTed when it ends.

A callback URL is a request the platform makes on a user's behalf, so it must not reach what only
the platform can reach (its database, Redis, a cloud metadata service at 169.254.169.254): private,
loopback, link-local and other non-public addresses are refused unless JOBS_CALLBACK_ALLOW_PRIVATE
is on. Checked when the job is created (a 400 then) and again before each delivery (DNS may change).

When a job ends (Job._ended, from whichever transition won), `schedule` marks its callback pending
and, after commit, sends the first attempt to the `callbacks` queue (jobs/tasks.py says why a queue
of its own). Each `attempt` is claimed on the job row, POSTs the job's summary signed with the
owner's CallbackSecret (HMAC-SHA256 over "<timestamp>.<body>", headers X-Timestamp and
X-Signature-256), records the answer on the row, and says when to try again: 2xx delivered;
408, 429, 5xx, timeouts and connection errors retried with exponential backoff up to
JOBS_CALLBACK_ATTEMPTS; other 4xx and 3xx (redirects are never followed) failed at once.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import http.client
import ipaddress
import json
import logging
import secrets
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import SplitResult, urlsplit

from django.conf import settings
from django.db import IntegrityError, transaction
from django.urls import reverse
from django.utils import timezone

from jobs import batches, enqueue
from jobs.batches import batch_object
from jobs.models import Batch, CallbackSecret, CallbackStatus, FileFormat, Job

logger = logging.getLogger(__name__)


class CallbackRefused(ValueError):
    """The callback URL is not one the platform will call; the message says why."""


class Unresolvable(CallbackRefused):
    """The host does not resolve now; unlike a private address, that may be a passing DNS failure."""


# IPv6 addresses that stand for an IPv4 address, which a translator or the host's own stack may
# deliver to: NAT64 (64:ff9b::10.0.0.1 reaches 10.0.0.1 through a NAT64 gateway) and SIIT's
# IPv4-translated ::ffff:0:a.b.c.d carry it in their last 32 bits, 6to4 (2002:0a00:0001::) after
# its prefix; the embedded address must be public too.
_EMBEDS_IPV4_LAST_32 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("::ffff:0:0:0/96"))
# Never public: local-use NAT64 (RFC 8215, translated inside the operator's own network) and the
# deprecated IPv4-compatible ::a.b.c.d (which includes :: and ::1).
_NEVER_PUBLIC = (ipaddress.IPv6Network("64:ff9b:1::/48"), ipaddress.IPv6Network("::/96"))


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.sixtofour:
        return address.sixtofour
    if any(address in network for network in _EMBEDS_IPV4_LAST_32):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped:
            return _public(address.ipv4_mapped)  # ::ffff:127.0.0.1 is loopback too
        if any(address in network for network in _NEVER_PUBLIC):
            return False
        embedded = _embedded_ipv4(address)
        if embedded is not None and not _public(embedded):
            return False
    return address.is_global and not address.is_multicast


def _port(parts: SplitResult) -> int:
    """The URL's port, or its scheme's default; ValueError for port 0 (which `parts.port or 80` would
    silently turn into 80: the request must go where the URL says, or nowhere)."""
    if parts.port == 0:
        raise ValueError("port 0 is not a port a callback can be sent to")
    return parts.port or (443 if parts.scheme == "https" else 80)


def check_destination(url: str, *, allow_private: bool) -> list[str]:
    """The addresses `url`'s host resolves to; CallbackRefused when the URL is not http(s), has no
    host, does not resolve, or (unless `allow_private`) any address is not a public one."""
    try:
        parts = urlsplit(url)
        port = _port(parts)
    except ValueError as exc:
        raise CallbackRefused(f"callback_url is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise CallbackRefused(f"callback_url must be http or https, got {parts.scheme or 'no scheme'!r}")
    if not parts.hostname:
        raise CallbackRefused("callback_url has no host")
    if "@" in parts.netloc:
        # Never sent (the receiver authenticates the signature), yet stored and shown to staff.
        raise CallbackRefused("callback_url must not hold a user name or password: the signature authenticates")
    infos = _resolve(parts.hostname, port)
    addresses = sorted({info[4][0] for info in infos})
    if not allow_private:
        for address in addresses:
            if not _public(ipaddress.ip_address(address.split("%")[0])):
                raise CallbackRefused(
                    f"callback_url's host {parts.hostname!r} is {address}, a private, loopback or link-local"
                    " address; callbacks go to public addresses only"
                )
    return addresses


# Name lookups run here with a time limit: a name server that never answers must cost a job upload (a
# web thread) seconds, not the resolver's own 30. The pool bounds the lookups still hanging.
_RESOLVE_TIMEOUT_S = 3.0
_resolver = ThreadPoolExecutor(max_workers=4, thread_name_prefix="callback-dns")


def _resolve(hostname: str, port: int) -> list:
    try:
        return _resolver.submit(socket.getaddrinfo, hostname, port, type=socket.SOCK_STREAM).result(_RESOLVE_TIMEOUT_S)
    except FutureTimeout:
        raise Unresolvable(
            f"callback_url's host {hostname!r} did not resolve within {_RESOLVE_TIMEOUT_S:.0f} s"
        ) from None
    except (OSError, UnicodeError) as exc:
        raise Unresolvable(f"callback_url's host {hostname!r} does not resolve: {exc}") from None


# Delivery -------------------------------------------------------------------------------------

SIGNATURE_HEADER = "X-Signature-256"
TIMESTAMP_HEADER = "X-Timestamp"
USER_AGENT = "inference-platform-callbacks/1"
# Of an error answer's body, this much is kept on the job row (the column holds 500 characters).
_ERROR_BODY_CHARS = 200


@dataclass(frozen=True)
class Answer:
    """What one attempt got: an HTTP status, or None with the error that prevented an answer."""

    status: int | None
    error: str = ""


class Outcome(enum.Enum):
    DELIVERED = "delivered"
    RETRY = "retry"
    GIVE_UP = "give_up"


def outcome_of(answer: Answer) -> Outcome:
    """2xx delivered; 408, 429 and 5xx (and no answer) worth another try; any other status final.

    A 4xx other than 408/429 says the receiver understood and refused (gone, unauthorized, bad
    request): asking again with the same body would get the same answer. A 3xx is final too, as
    redirects are not followed (the target could be a private address the check never saw).
    """
    if answer.status is None:
        return Outcome.RETRY
    if 200 <= answer.status < 300:
        return Outcome.DELIVERED
    if answer.status in (408, 429) or answer.status >= 500:
        return Outcome.RETRY
    return Outcome.GIVE_UP


def retry_delay_s(attempt: int, backoff_s: float) -> float:
    """Wait before attempt `attempt + 1`: backoff_s, then doubled each time (30 s, 1, 2, 4, 8 min by default)."""
    return backoff_s * 2 ** (attempt - 1)


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def rotate_secret(owner) -> CallbackSecret:
    """A new secret for `owner`, replacing any earlier one; the only time its value leaves the server."""
    try:
        secret, _ = CallbackSecret.objects.update_or_create(owner=owner, defaults={"secret": new_secret()})
    except IntegrityError:  # a concurrent first rotation created it: this one replaces it
        secret = CallbackSecret.objects.get(owner=owner)
        secret.secret = new_secret()
        secret.save(update_fields=["secret", "created_at"])
    return secret


def secret_for(owner_id: int) -> str:
    """The owner's signing secret. Job creation asks for one first; created here only if it was deleted
    (an admin revoking it) after the job was created, so the callback is still signed: the owner must
    rotate it to learn it."""
    try:
        secret, _ = CallbackSecret.objects.get_or_create(owner_id=owner_id, defaults={"secret": new_secret()})
    except IntegrityError:  # created meanwhile by a concurrent delivery for another of their jobs
        secret = CallbackSecret.objects.get(owner_id=owner_id)
    return secret.secret


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """`sha256=<hex>` of HMAC-SHA256(secret, "<timestamp>." + body): the X-Signature-256 header."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def payload(job: Job) -> dict[str, Any]:
    """The job's summary as POSTed. Links are absolute under JOBS_CALLBACK_BASE_URL, else paths."""
    base = settings.JOBS_CALLBACK_BASE_URL.rstrip("/")

    def link(name: str) -> str:
        return base + reverse(name, args=[job.pk])

    def when(value: datetime | None) -> str | None:
        return value.isoformat() if value else None

    summary = {
        "event": "job.ended",
        "id": job.pk,
        "status": job.status,
        "model": job.model,
        "filename": job.filename,
        "total_rows": job.total_rows,
        "done_rows": job.done_rows,
        "failed_rows": job.failed_rows,
        "created_at": when(job.created_at),
        "started_at": when(job.started_at),
        "finished_at": when(job.finished_at),
        "error": job.error,
        "links": {"self": link("job-detail"), "results": link("job-results"), "results_csv": link("job-results-csv")},
    }
    batch = Batch.objects.filter(job=job).select_related("job", "input_file", "output_file", "error_file").first()
    if batch is not None:  # batch.completed, batch.failed, batch.expired or batch.cancelled, with the batch object
        shown = batch_object(batch)
        summary.update(event=f"batch.{shown['status']}", batch=shown)
    return summary


def body_of(job: Job) -> bytes:
    """The exact bytes sent (and signed): the same on every attempt for one end of the job."""
    return json.dumps(payload(job), separators=(",", ":"), sort_keys=True).encode()


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """Connects to an address already checked, while TLS verifies the certificate for the URL's host name."""

    def __init__(self, address: str, port: int, hostname: str, timeout_s: float) -> None:
        super().__init__(address, port, timeout=timeout_s, context=ssl.create_default_context())
        self._hostname = hostname

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # plain TCP to the pinned address
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._hostname)


def post(url: str, body: bytes, headers: dict[str, str], *, timeout_s: float, allow_private: bool) -> Answer:
    """One POST of `body` to `url`, redirects not followed, to an address checked just before.

    The connection goes to an address check_destination returned, not to whatever the name resolves
    to a moment later: a DNS answer that changes between the check and the connection (rebinding)
    cannot steer the request to a private address. Raises CallbackRefused when the check refuses.
    """
    deadline = time.monotonic() + timeout_s
    addresses = check_destination(url, allow_private=allow_private)
    parts = urlsplit(url)
    hostname = parts.hostname or ""
    port = _port(parts)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    # An internationalised host name goes in the Host header as IDNA (http.client sends Latin-1 only).
    host_header = hostname.encode("idna").decode("ascii") if not hostname.isascii() else parts.netloc
    if parts.port and not hostname.isascii():
        host_header += f":{parts.port}"
    errors = []
    for address in addresses[:_MAX_ADDRESSES]:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            errors.append(f"{address}: not tried, the attempt's {timeout_s:.0f} s were spent")
            break
        if parts.scheme == "https":
            connection: http.client.HTTPConnection = _PinnedHTTPSConnection(address, port, hostname, remaining_s)
        else:
            connection = http.client.HTTPConnection(address, port, timeout=remaining_s)
        # A socket timeout bounds each read, not the answer: a receiver trickling a byte a second would
        # hold the attempt for ever. At the deadline the socket is shut, which ends any read in progress.
        watchdog = threading.Timer(remaining_s, _cut, args=(connection,))
        watchdog.daemon = True
        watchdog.start()
        try:
            connection.request("POST", target, body=body, headers={**headers, "Host": host_header})
            response = connection.getresponse()
            status = response.status
            detail = "" if 200 <= status < 300 else response.read(_ERROR_BODY_CHARS).decode("utf-8", "replace")
            if 300 <= status < 400:
                detail = f"redirect to {response.getheader('Location', '?')} not followed"
            return Answer(status, detail.strip())
        except (OSError, http.client.HTTPException, ValueError) as exc:
            # Connection refused or reset, timeout, TLS failure, cut at the deadline: try the next address.
            reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
            if time.monotonic() >= deadline:
                reason = f"TimeoutError: no complete answer within the attempt's {timeout_s:.0f} s"
            errors.append(f"{address}: {reason}")
        finally:
            watchdog.cancel()
            connection.close()
    return Answer(None, "; ".join(errors) or "no address to connect to")


# A host's first two addresses are tried (its IPv6 and IPv4, say); more would multiply the attempt's time.
_MAX_ADDRESSES = 2


def _cut(connection: http.client.HTTPConnection) -> None:
    """End the connection's reads and writes now (from the watchdog's thread)."""
    sock = connection.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def announced_outcome(job: Job) -> str:
    """What a receiver learns from an end: its status and row counts (the rest of the summary follows)."""
    return f"{job.status} {job.done_rows}/{job.failed_rows}/{job.total_rows}"


def schedule(job: Job, **_: Any) -> None:
    """The job has just ended (its terminal transition won): start its callback, if it has one.

    Called once per end, as a receiver of jobs.signals.job_ended. A callback tells its receiver that
    the job's results are there, or have changed: each end whose outcome (status and row counts) the
    receiver has not been delivered yet is announced, once. A retry of the failed rows ends the job
    again: if some rows now succeed (or it is cancelled), the receiver gets the new summary; if every
    retried row fails again, the outcome is the one already delivered, and a second identical summary
    would only be noise (retried in a loop, a flood on the receiver), so none is sent and the record
    keeps the earlier delivery. Each end is named by its finished_at, so attempts still pending for an
    earlier end stop, and that end, never delivered, is announced with the next one.
    """
    if not job.callback_url or job.finished_at is None:
        return
    if job.file_format == FileFormat.BATCH and not batches.finalized(job):
        return  # a batch calls back once its output files are written (jobs/batches.finalize calls this again)
    outcome = announced_outcome(job)
    fields: dict[str, Any] = {
        "callback_status": CallbackStatus.PENDING,
        "callback_attempts": 0,
        "callback_last_status": None,
        "callback_last_error": "",
        "callback_last_at": None,
    }
    this_end = Job.objects.filter(pk=job.pk, finished_at=job.finished_at)
    if not this_end.exclude(callback_status=CallbackStatus.DELIVERED, callback_outcome=outcome).update(**fields):
        if this_end.exists():
            logger.info("job %s ended again as before (%s), already delivered: not called back again", job.pk, outcome)
        return  # else requeued already: its next end will call back
    for name, value in fields.items():
        setattr(job, name, value)
    ended_at = job.finished_at.isoformat()
    job_id = job.pk

    def send() -> None:
        # After the job's end is committed: a broker outage must not turn that end (a cancel, the last
        # chunk of a batch of several jobs) into an error. The record stays pending with no attempt, and
        # the reconciler sends it once the broker is back (resend_lost).
        try:
            enqueue.callback_attempt(job_id, ended_at, attempt=1)
        except Exception:
            logger.warning("job %s: callback not queued now; the reconciler will send it", job_id, exc_info=True)

    transaction.on_commit(send)


def attempt(job_id: int, ended_at: str, number: int, *, now: datetime | None = None) -> float | None:
    """Make delivery attempt `number` for the end of job `job_id` at `ended_at`; seconds until the next
    attempt, or None when there is none (delivered, given up, or this message is stale).

    The attempt is claimed first by a conditional UPDATE (attempts n-1 -> n, for this end, still
    pending): a redelivered or duplicated message claims nothing and sends nothing.
    """
    now = now or timezone.now()
    mine = Job.objects.filter(
        pk=job_id,
        finished_at=datetime.fromisoformat(ended_at),
        callback_status=CallbackStatus.PENDING,
        callback_attempts=number - 1,
    )
    if not mine.update(callback_attempts=number, callback_last_at=now):
        return None
    # Read for this end only: a retry of its failed rows (finished_at cleared) or a deletion since the
    # claim means there is nothing to announce, and an announcement now would be false.
    job = Job.objects.filter(pk=job_id, finished_at=datetime.fromisoformat(ended_at)).first()
    if job is None:
        return None
    body = body_of(job)
    timestamp = int(now.timestamp())
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: sign(secret_for(job.owner_id), timestamp, body),
        "X-Job-Id": str(job.pk),
        "X-Callback-Attempt": str(number),
    }
    try:
        answer = post(
            job.callback_url,
            body,
            headers,
            timeout_s=settings.JOBS_CALLBACK_TIMEOUT_S,
            allow_private=settings.JOBS_CALLBACK_ALLOW_PRIVATE,
        )
        outcome = outcome_of(answer)
    except Unresolvable as refused:
        answer, outcome = Answer(None, str(refused)), Outcome.RETRY
    except CallbackRefused as refused:  # now a private address: policy, not a passing failure
        answer, outcome = Answer(None, str(refused)), Outcome.GIVE_UP
    except Exception as exc:  # anything else (the task's time limit): recorded, retried
        answer, outcome = Answer(None, f"{type(exc).__name__}: {exc}"), Outcome.RETRY
    last = number >= settings.JOBS_CALLBACK_ATTEMPTS
    if outcome is Outcome.DELIVERED:
        status = CallbackStatus.DELIVERED
    elif outcome is Outcome.GIVE_UP or last:
        status = CallbackStatus.FAILED
    else:
        status = CallbackStatus.PENDING
    mine = Job.objects.filter(
        pk=job_id, finished_at=job.finished_at, callback_attempts=number, callback_status=CallbackStatus.PENDING
    )
    # The outcome delivered, so that an end repeating it is not announced again (schedule).
    delivered = {"callback_outcome": announced_outcome(job)} if status == CallbackStatus.DELIVERED else {}
    mine.update(
        callback_status=status, callback_last_status=answer.status, callback_last_error=answer.error[:500], **delivered
    )
    log = logger.info if status == CallbackStatus.DELIVERED else logger.warning
    log("job %s callback attempt %d: %s (%s)", job_id, number, answer.status or answer.error, status)
    if status != CallbackStatus.PENDING:
        return None
    return retry_delay_s(number, settings.JOBS_CALLBACK_BACKOFF_S)


def resend_lost(now: datetime, stall_s: float) -> int:
    """Send again the callbacks whose next attempt is overdue by stall_s: its message was lost (a worker
    killed mid-attempt, a process that died between a job's end and the send, a Redis that lost its lists).

    Run by the reconciler. A resend that meets the original (only late, not lost) is harmless: the
    attempt is claimed by number, so one of the two sends and the other finds it taken. A callback
    whose last attempt was lost is failed. Returns how many were sent again.
    """
    resent = 0
    pending = Job.objects.filter(callback_status=CallbackStatus.PENDING, finished_at__isnull=False)
    for job in pending.only("pk", "finished_at", "callback_attempts", "callback_last_at"):
        attempts = job.callback_attempts
        if attempts == 0:
            # callback_last_at: when it was last resent, if it was (a message only waiting is resent
            # once per stall interval, not on every tick)
            due = job.callback_last_at or job.finished_at
        else:
            # The attempt runs up to its deadline (post()), plus a lookup, then its retry waits out its backoff.
            running_s = settings.JOBS_CALLBACK_TIMEOUT_S + _RESOLVE_TIMEOUT_S
            due = job.callback_last_at + timedelta(
                seconds=running_s + retry_delay_s(attempts, settings.JOBS_CALLBACK_BACKOFF_S)
            )
        if due > now - timedelta(seconds=stall_s):
            continue
        if attempts >= settings.JOBS_CALLBACK_ATTEMPTS:
            Job.objects.filter(pk=job.pk, callback_status=CallbackStatus.PENDING, callback_attempts=attempts).update(
                callback_status=CallbackStatus.FAILED, callback_last_error="the last attempt was lost with its worker"
            )
            continue
        # Noted first, so that the next tick does not resend it again while this message waits.
        if not Job.objects.filter(pk=job.pk, callback_status=CallbackStatus.PENDING, callback_attempts=attempts).update(
            callback_last_at=now
        ):
            continue
        enqueue.callback_attempt(job.pk, job.finished_at.isoformat(), attempts + 1)
        resent += 1
    return resent
