"""Job callbacks: where a job's summary may be POSTed when it ends.

A callback URL is a request the platform makes on a user's behalf, so it must not reach what only
the platform can reach (its database, Redis, a cloud metadata service at 169.254.169.254): private,
loopback, link-local and other non-public addresses are refused unless JOBS_CALLBACK_ALLOW_PRIVATE
is on. Checked when the job is created (a 400 then) and again before each delivery (DNS may change).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit


class CallbackRefused(ValueError):
    """The callback URL is not one the platform will call; the message says why."""


def _public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is loopback too
    return address.is_global and not address.is_multicast


def check_destination(url: str, *, allow_private: bool) -> list[str]:
    """The addresses `url`'s host resolves to; CallbackRefused when the URL is not http(s), has no
    host, does not resolve, or (unless `allow_private`) any address is not a public one."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise CallbackRefused(f"callback_url is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise CallbackRefused(f"callback_url must be http or https, got {parts.scheme or 'no scheme'!r}")
    if not parts.hostname:
        raise CallbackRefused("callback_url has no host")
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise CallbackRefused(f"callback_url's host {parts.hostname!r} does not resolve: {exc}") from None
    addresses = sorted({info[4][0] for info in infos})
    if not allow_private:
        for address in addresses:
            if not _public(ipaddress.ip_address(address.split("%")[0])):
                raise CallbackRefused(
                    f"callback_url's host {parts.hostname!r} is {address}, a private, loopback or link-local"
                    " address; callbacks go to public addresses only"
                )
    return addresses
