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


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the header time, size and count limits and connection limits."""

    # Connections held by this process, per client address (the protocol's instances share one process).
    by_address: dict[str, set[GuardedHttpProtocol]] = {}

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._limits = limits()
        self._address = ""
        self._counted = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_seen_at = 0.0
        self._reading_headers = True
        self._header_bytes = 0
        self._parsed_header_bytes = 0
        self._refusal: bytes | None = None
        peer = transport.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple | list) and peer else ""
        refusal = self._admission_refusal(address)
        if refusal is not None:
            # Answered and closed at once: the descriptor is freed as soon as the answer is written.
            # connection_lost still runs, so the base's state must exist.
            super().connection_made(transport)
            self.connections.discard(self)
            transport.write(refusal)
            transport.close()
            return
        super().connection_made(transport)
        self._address, self._counted = address, True
        self.by_address.setdefault(address, set()).add(self)
        self._arm_header_timer()

    def _admission_refusal(self, address: str) -> bytes | None:
        lim = self._limits
        mine = len(self.by_address.get(address, ()))
        if mine >= lim.max_connections_per_address and not lim.trusted(address):
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
        """At the process limit, close an idle connection (waiting for a request's headers) of the address
        that holds the most, if that is more than the newcomer's address holds: a flood from many
        addresses then costs a client with few connections nothing, and the flood itself its oldest."""
        top = max(self.by_address, key=lambda address: len(self.by_address[address]), default=None)
        if top is None or len(self.by_address[top]) <= mine + 1:
            return False
        idle = next((conn for conn in self.by_address[top] if conn._idle()), None)
        if idle is None:
            return False
        idle._refuse(
            canned(
                503,
                "Service Unavailable",
                "too_many_connections",
                "this server process is at its connection limit and closed an idle connection of the address"
                " holding the most",
                retry_after_s=1,
            )
        )
        idle._forget()  # its slot is the newcomer's now; connection_lost comes later
        return True

    def _idle(self) -> bool:
        return self._reading_headers and (self.cycle is None or self.cycle.response_complete)

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
        self._cancel_header_timer()
        self._cancel_body_timer()
        self._forget()
        super().connection_lost(exc)

    # --- header time -----------------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        if self._header_timer is None and self._limits.header_timeout_s > 0:
            self._header_timer = self.loop.call_later(self._limits.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._reading_headers and not self.transport.is_closing():
            self._refuse(
                canned(
                    408,
                    "Request Timeout",
                    "header_timeout",
                    f"the request line and headers did not arrive within {self._limits.header_timeout_s:g} s",
                )
            )

    # --- body time -------------------------------------------------------------------------
    # One timer per request body, not one per chunk: it re-arms itself for the time left since the
    # last chunk arrived.
    def _arm_body_timer(self, delay_s: float) -> None:
        self._body_timer = self.loop.call_later(delay_s, self._body_idle)

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_idle(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        idle_s = self.loop.time() - self._body_seen_at
        if idle_s < self._limits.body_idle_timeout_s:
            self._arm_body_timer(self._limits.body_idle_timeout_s - idle_s)
            return
        self.logger.info("closing a connection whose request body stopped for %.0f s", idle_s)
        self.transport.close()  # the view's receive() gets http.disconnect

    def on_body(self, body: bytes) -> None:
        self._body_seen_at = self.loop.time()
        super().on_body(body)

    # --- header size and count -------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._reading_headers:
            self._header_bytes += len(data)
            # Bytes that never start a request (blank lines between kept-alive requests) cancel
            # uvicorn's keep-alive timer below; this clock keeps running for them.
            self._arm_header_timer()
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
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
        # Still in the headers after this read: what arrived so far is all header (a read that also
        # finished the headers may carry body bytes, and those are not counted).
        if self._reading_headers and self._header_bytes > self._limits.max_header_bytes:
            self._refuse(self._too_large())

    def _too_large(self) -> bytes:
        return canned(
            431,
            "Request Header Fields Too Large",
            "headers_too_large",
            f"the request line and headers pass {self._limits.max_header_bytes} bytes, the limit",
        )

    def _refuse(self, answer: bytes) -> None:
        self._reading_headers = False
        self._cancel_header_timer()
        if not self.transport.is_closing():
            self.transport.write(answer)
            self.transport.close()

    def _count(self, n_bytes: int) -> None:
        # The parser hands a header over only when it is whole, so a long one that arrived in one read
        # is caught here, before the request starts.
        self._parsed_header_bytes += n_bytes
        if self._parsed_header_bytes > self._limits.max_header_bytes:
            self._refusal = self._too_large()
            raise _HeaderLimitExceeded

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_headers = True
        self._parsed_header_bytes = 0
        self._arm_header_timer()  # on a kept-alive connection the clock starts at the request's first byte

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        if len(self.headers) >= self._limits.max_headers:
            self._refusal = canned(
                431,
                "Request Header Fields Too Large",
                "too_many_headers",
                f"the request has more than {self._limits.max_headers} header fields, the limit",
            )
            raise _HeaderLimitExceeded
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self._cancel_header_timer()
        super().on_headers_complete()
        if self._limits.body_idle_timeout_s > 0 and self._body_timer is None:
            self._body_seen_at = self.loop.time()
            self._arm_body_timer(self._limits.body_idle_timeout_s)

    def on_message_complete(self) -> None:
        self._cancel_body_timer()
        super().on_message_complete()
        # What arrives next belongs to the next request's headers (counted from here).
        self._reading_headers, self._header_bytes = True, 0


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
