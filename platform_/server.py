"""The web server: uvicorn with the limits a shared service needs before any view runs.

    python -m platform_.server [--host 127.0.0.1] [--port 8000] [--workers 2] [other uvicorn options]

uvicorn's HTTP protocol (httptools) keeps a connection that never finishes its headers open for ever,
buffers a header of any size and any number of headers, and accepts connections until the process
runs out of file descriptors; its default trusts X-Forwarded-For from 127.0.0.1. Seen on this
platform: two clients holding 19,000 idle connections each took a web process to its descriptor
limit and about half of another user's requests failed with "connection reset"; one 16 MB header got
200; 20 unfinished connections of 40 MB of headers each grew the web processes by 800 MB. Behind a
proxy the proxy bounds these, but `make run` has none, so the server bounds them itself:

- header time: a request's line and headers must arrive within WEB_HEADER_TIMEOUT_S of the connection
  opening (or of the request's first byte on a kept-alive connection), else 408 and close;
- body time: a request body that stops arriving for WEB_BODY_IDLE_TIMEOUT_S is given up (the
  connection closes; the view sees the client leave), so a slow-body client cannot hold a connection
  and its half-read upload for ever either;
- header size and count: more than WEB_MAX_HEADER_BYTES of request line and headers, or more than
  WEB_MAX_HEADERS fields, gets 431 and close, before the rest is read or kept;
- connections: a process holds at most WEB_MAX_CONNECTIONS (clamped below its descriptor limit, so
  its own Redis and database connections always have descriptors), and at most
  WEB_MAX_CONNECTIONS_PER_ADDRESS from one client address (the trusted proxies excepted); a connection
  over either is answered at once (503 or 429, JSON, Retry-After) and closed, so it holds no
  descriptor. A flood from one address then costs others nothing but accept() calls; at the process
  limit a newcomer takes the place of an idle connection of the address holding the most.
- forwarded addresses: X-Forwarded-For and X-Forwarded-Proto are taken only from FORWARDED_ALLOW_IPS
  (empty by default: no proxy, so nobody may say who the client is).

Why a protocol subclass and not uvicorn's h11 (which bounds header size): httptools parses in C; the
platform's own per-request cost is a benchmark target (docs/benchmarks.md), and these checks add a
counter and a timer per connection. The limits live in settings (platform_/settings/base.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import resource
import sys
from dataclasses import dataclass
from functools import cache

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

APP = "platform_.asgi:application"
PROTOCOL = "platform_.server:GuardedHttpProtocol"
# Descriptors kept for the process's own use (Redis and database connections, files, the event loop):
# the connection limit is clamped to the descriptor limit less these.
RESERVED_FDS = 512


@dataclass(frozen=True)
class Limits:
    header_timeout_s: float
    body_idle_timeout_s: float
    min_body_bytes_per_s: float
    write_timeout_s: float
    max_pipelined: int
    max_header_bytes: int
    max_headers: int
    max_connections: int
    max_connections_per_address: int
    trusted_proxies: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    trust_all_proxies: bool

    def trusted(self, address: str) -> bool:
        if self.trust_all_proxies:
            return True
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self.trusted_proxies)


def parse_networks(value: str) -> tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...], bool]:
    """FORWARDED_ALLOW_IPS as uvicorn reads it (addresses or networks, comma-separated, '*' for any)."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    if "*" in items:
        return (), True
    return tuple(ipaddress.ip_network(item, strict=False) for item in items), False


def descriptor_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_limit(configured: int, fd_limit: int) -> int:
    """The connections a process may hold: the setting, below the descriptor limit less the reserve."""
    return max(1, min(configured, fd_limit - RESERVED_FDS))


@cache
def limits() -> Limits:
    """Read once per process, after the app (and so Django's settings) is loaded."""
    from django.conf import settings

    networks, trust_all = parse_networks(settings.FORWARDED_ALLOW_IPS)
    return Limits(
        header_timeout_s=settings.WEB_HEADER_TIMEOUT_S,
        body_idle_timeout_s=settings.WEB_BODY_IDLE_TIMEOUT_S,
        min_body_bytes_per_s=max(settings.WEB_MIN_BODY_BYTES_PER_S, 1.0),
        write_timeout_s=settings.WEB_WRITE_TIMEOUT_S,
        max_pipelined=settings.WEB_MAX_PIPELINED,
        max_header_bytes=settings.WEB_MAX_HEADER_BYTES,
        max_headers=settings.WEB_MAX_HEADERS,
        max_connections=connection_limit(settings.WEB_MAX_CONNECTIONS, descriptor_limit()),
        max_connections_per_address=settings.WEB_MAX_CONNECTIONS_PER_ADDRESS,
        trusted_proxies=networks,
        trust_all_proxies=trust_all,
    )


def canned(status: int, reason: str, code: str, detail: str, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, written before (or instead of) reading a request."""
    body = json.dumps({"detail": detail, "code": code}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}"]
    if retry_after_s is not None:
        head.append(f"retry-after: {retry_after_s}")
    head.append("connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


class _HeaderLimitExceeded(Exception):
    """Raised from a parser callback: httptools stops parsing and data_received answers 431."""


# What a connection is doing, for the clocks and for choosing one to close at the process limit.
HEADERS, BODY, DONE = "headers", "body", "done"


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with time, size and connection limits (module docstring).

    The clocks are not a timer per request: one sweep per process and second looks at every
    connection's deadlines (a request costs a few attribute writes, not a timer armed and cancelled).
    """

    # Connections held by this process, per client address (IPv6: per /64, what one host is given).
    by_address: dict[str, set[GuardedHttpProtocol]] = {}
    _sweeping: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._limits = limits()
        self._address = ""
        self._counted = False
        self._phase = HEADERS
        self._header_deadline: float | None = None
        self._header_bytes = 0
        self._framing_bytes = 0
        self._body_in_read = 0
        self._body_started_at = self._body_seen_at = 0.0
        self._body_bytes = 0
        self._write_blocked_since: float | None = None
        self._running: object | None = None
        self._refusal: bytes | None = None
        peer = transport.get_extra_info("peername")
        peer_address = peer[0] if isinstance(peer, tuple | list) and peer else ""
        address = holder(peer_address)
        refusal = self._admission_refusal(address, peer_address)
        super().connection_made(transport)
        if refusal is not None:
            # Answered and closed at once: the descriptor is freed as soon as the answer is written.
            self.connections.discard(self)
            transport.write(refusal)
            transport.close()
            return
        self._address, self._counted = address, True
        self.by_address.setdefault(address, set()).add(self)
        self._header_deadline = self.loop.time() + self._limits.header_timeout_s
        self._start_sweeping()

    # --- connections per address and per process ----------------------------------------------
    def _admission_refusal(self, address: str, peer_address: str) -> bytes | None:
        lim = self._limits
        mine = len(self.by_address.get(address, ()))
        # A proxy's address is checked only at the limit: every connection would parse it otherwise.
        if mine >= lim.max_connections_per_address and not lim.trusted(peer_address):
            return canned(
                429,
                "Too Many Requests",
                "too_many_connections",
                f"{address} holds {lim.max_connections_per_address} connections to this server process, its limit;"
                " reuse them (keep-alive) or close some",
                retry_after_s=1,
            )
        if len(self.server_state.connections) >= lim.max_connections and not self._make_room(mine):
            return canned(
                503,
                "Service Unavailable",
                "too_many_connections",
                f"this server process holds its limit of {lim.max_connections} connections; try again shortly",
                retry_after_s=1,
            )
        return None

    def _make_room(self, mine: int) -> bool:
        """At the process limit, close a connection that is not being served (waiting for headers,
        sending a body, or not reading its answer) of the address that holds the most, if that is more
        than the newcomer's address holds: a flood from many addresses then costs a client with few
        connections nothing, and the flood itself its own connections."""
        top = max(self.by_address, key=lambda address: len(self.by_address[address]), default=None)
        if top is None or len(self.by_address[top]) <= mine + 1:
            return False
        spare = next((conn for conn in self.by_address[top] if conn._spare()), None)
        if spare is None:
            return False
        if spare._phase == HEADERS and not spare._in_flight():
            spare._refuse(
                canned(
                    503,
                    "Service Unavailable",
                    "too_many_connections",
                    "this server process is at its connection limit and closed a waiting connection of the"
                    " address holding the most",
                    retry_after_s=1,
                )
            )
        else:
            spare.transport.close()  # mid-request: no answer can be written in between
        spare._forget()  # its slot is the newcomer's now; connection_lost comes later
        return True

    def _in_flight(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _spare(self) -> bool:
        """Not being served: waiting for a request's headers, sending its body, or not reading its answer."""
        waiting = self._phase == HEADERS and not self._in_flight()
        return waiting or self._phase == BODY or self._write_blocked_since is not None

    def _forget(self) -> None:
        if self._counted:
            self._counted = False
            held = self.by_address.get(self._address)
            if held is not None:
                held.discard(self)
                if not held:
                    del self.by_address[self._address]
        self.connections.discard(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        # uvicorn marks only the last parsed request as disconnected; the one being served (pipelining)
        # and those queued behind it must hear it too, or they wait on a send that cannot finish.
        for cycle in [self._running, *(cycle for cycle, _ in self.pipeline)]:
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)

    # --- the clocks ---------------------------------------------------------------------------
    @classmethod
    def _start_sweeping(cls) -> None:
        if cls._sweeping is None:
            cls._sweeping = asyncio.get_event_loop().call_later(1.0, cls._sweep)

    @classmethod
    def _sweep(cls) -> None:
        cls._sweeping = None
        now = asyncio.get_event_loop().time()
        for held in list(cls.by_address.values()):
            for conn in list(held):
                conn._check(now)
        if cls.by_address:
            cls._start_sweeping()

    def _check(self, now: float) -> None:
        lim = self._limits
        if self._write_blocked_since is not None and now - self._write_blocked_since > lim.write_timeout_s:
            # Closing or not: close() waits for the unread answer to drain, which it never will.
            self.logger.info("closing a connection that has not read its answer for %.0f s", lim.write_timeout_s)
            self._write_blocked_since = None
            self.transport.abort()
            return
        if self.transport.is_closing():
            return
        if self._phase == HEADERS and self._header_deadline is not None and now > self._header_deadline:
            self._refuse(
                canned(
                    408,
                    "Request Timeout",
                    "header_timeout",
                    f"the request line and headers did not arrive within {lim.header_timeout_s:g} s",
                )
            )
        elif (
            self._phase == BODY
            and lim.body_idle_timeout_s > 0
            and (
                now - self._body_seen_at > lim.body_idle_timeout_s
                # A body must also keep a minimum rate on average (as Apache's mod_reqtimeout MinRate): one
                # byte every 20 s never goes idle, yet would hold the connection for ever.
                or now > self._body_started_at + lim.body_idle_timeout_s + self._body_bytes / lim.min_body_bytes_per_s
            )
        ):
            self.logger.info("closing a connection whose request body stopped or crawls (%d bytes)", self._body_bytes)
            self.transport.close()  # the view's receive() gets http.disconnect

    def pause_writing(self) -> None:
        self._write_blocked_since = self.loop.time()
        super().pause_writing()

    def resume_writing(self) -> None:
        self._write_blocked_since = None
        super().resume_writing()

    # --- reading: header size and count, framing after the headers, pipelining ----------------
    def data_received(self, data: bytes) -> None:
        in_headers = self._phase == HEADERS
        if in_headers:
            self._header_bytes += len(data)
            # Bytes that start (or never start) the next request on a kept-alive connection cancel
            # uvicorn's keep-alive timer below; the header clock runs for them.
            self._start_header_clock()
        self._body_in_read = 0
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No WebSocket here (_should_upgrade_to_ws): the request is served as plain HTTP.
            self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._refusal is not None:  # a limit raised from a parser callback
                self._refuse(self._refusal)
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        if self._phase == HEADERS and self._header_bytes > self._limits.max_header_bytes:
            # Still in the headers after this read: what arrived so far is all header.
            self._refuse(self._too_large())
        elif not in_headers and self._phase != HEADERS and self._body_in_read == 0:
            # After the headers, bytes that carry no body (chunk framing, trailers): httptools keeps an
            # unfinished trailer in memory, so these are bounded as headers are. Body bytes reset it.
            self._framing_bytes += len(data)
            if self._framing_bytes > self._limits.max_header_bytes:
                self.logger.info("closing a connection sending %d bytes of framing and no body", self._framing_bytes)
                self.transport.close()

    def _start_header_clock(self) -> None:
        """Start the header clock unless it runs already, or an answer is still being sent: a 408 must
        not land in the middle of it."""
        if self._header_deadline is None and not self._in_flight():
            self._header_deadline = self.loop.time() + self._limits.header_timeout_s

    def _too_large(self) -> bytes:
        return canned(
            431,
            "Request Header Fields Too Large",
            "headers_too_large",
            f"the request line and headers pass {self._limits.max_header_bytes} bytes, the limit",
        )

    def _refuse(self, answer: bytes) -> None:
        self._phase, self._header_deadline = DONE, None
        if not self.transport.is_closing():
            if answer:
                self.transport.write(answer)
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase, self._framing_bytes = HEADERS, 0
        self._start_header_clock()

    def on_headers_complete(self) -> None:
        lim = self._limits
        if len(self.headers) > lim.max_headers:
            self._refusal = canned(
                431,
                "Request Header Fields Too Large",
                "too_many_headers",
                f"the request has more than {lim.max_headers} header fields, the limit",
            )
            raise _HeaderLimitExceeded
        # Headers that arrived whole in one read (up to 256 KiB) were not stopped as partial ones are: count
        # them when that read was larger than the limit (it usually is a few hundred bytes), or was not
        # counted (a request pipelined behind another in one read).
        if (self._header_bytes > lim.max_header_bytes or self._header_bytes == 0) and (
            len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers) > lim.max_header_bytes
        ):
            self._refusal = self._too_large()
            raise _HeaderLimitExceeded
        if len(self.pipeline) >= lim.max_pipelined:
            # Requests sent ahead without waiting for answers are parsed from what was already read
            # even while reading is paused; past a few, the client is flooding, not pipelining.
            self.logger.info("closing a connection with more than %d pipelined requests", lim.max_pipelined)
            self._refusal = b""
            raise _HeaderLimitExceeded
        self._phase, self._header_deadline, self._header_bytes = BODY, None, 0
        self._body_started_at = self._body_seen_at = self.loop.time()
        self._body_bytes = 0
        super().on_headers_complete()

    def _should_upgrade_to_ws(self) -> bool:
        # The app has no WebSocket routes; handing the connection to uvicorn's WebSocket protocol left it
        # counted against its address for ever (that protocol never reaches our connection_lost).
        return False

    def _start_asgi_task(self, cycle, app) -> None:  # type: ignore[no-untyped-def]
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        self._body_in_read += len(body)
        self._body_bytes += len(body)
        self._body_seen_at = self.loop.time()
        self._framing_bytes = 0
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # What arrives next belongs to the next request's headers (counted from here).
        self._phase, self._header_bytes = HEADERS, 0


def holder(address: str) -> str:
    """Who holds a connection, for the per-address limit: the address, or its /64 for IPv6 (one host
    is commonly given a whole /64, so counting single addresses would give it millions of limits)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 4:
        return address
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{address}/64", strict=False))


def raise_descriptor_limit() -> None:
    """Raise the soft descriptor limit to the hard one (the workers inherit it): the connection limit
    is clamped below it, so a low soft limit (1024 on many systems) would cap connections needlessly."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def uvicorn_args(argv: list[str], forwarded_allow_ips: str) -> list[str]:
    """uvicorn's command line: this app and protocol, proxy headers only from configured proxies, then
    the caller's options (given later, they win where they repeat one)."""
    proxy = ["--proxy-headers", "--forwarded-allow-ips", forwarded_allow_ips] if forwarded_allow_ips.strip() else []
    return [
        APP,
        "--http",
        PROTOCOL,
        *(proxy or ["--no-proxy-headers"]),
        "--no-access-log",
        "--timeout-graceful-shutdown",
        "5",
        *argv,
    ]


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings.local")
    from django.conf import settings
    from uvicorn.main import main as uvicorn_main

    raise_descriptor_limit()
    uvicorn_main.main(args=uvicorn_args(sys.argv[1:] if argv is None else argv, settings.FORWARDED_ALLOW_IPS))


if __name__ == "__main__":
    main()
