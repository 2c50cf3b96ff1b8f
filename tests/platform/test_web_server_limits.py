"""The web server's own limits (platform_/server.py), live: header time, header size and count,
connections per address and per process, and whose X-Forwarded-For is believed (issue #25).

Each test talks HTTP over real sockets to a real `python -m platform_.server` process. The attacker
binds another loopback address (127.0.0.2 and up) than the other client (127.0.0.1), as two hosts would.
Servers with small limits run beside the stack's, on their own Redis database, so their counters never
touch the stack's.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from tests.conftest import _start, _stop, free_port, wait_until

pytestmark = pytest.mark.integration

HEADER_TIMEOUT_S = 1.0
BODY_IDLE_TIMEOUT_S = 2.0
WRITE_TIMEOUT_S = 2.0
BIG_STATIC = "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js"  # about 1.5 MB
PER_ADDRESS = 20
PER_PROCESS = 50
AUTH_FAILURES = 3


def _server(stack, tmp_path, name: str, **overrides: str) -> tuple[str, object]:
    env = {
        **stack.env,
        "REDIS_URL": stack.env["REDIS_URL"].rsplit("/", 1)[0] + "/12",
        "AUTH_FAILURES_PER_WINDOW": str(AUTH_FAILURES),
        "AUTH_FAILURE_WINDOW_S": "60",
        **overrides,
    }
    port = free_port()
    web = _start([sys.executable, "-m", "platform_.server", "--port", str(port)], env, tmp_path / f"{name}.log")
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert web.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
        try:
            return requests.get(f"{url}/api/v1/health", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    wait_until(up, 60, f"the {name} web process")
    return url, web


@pytest.fixture
def strict(stack, tmp_path) -> Iterator[str]:
    """A web process with a 1 s header timeout."""
    url, web = _server(
        stack,
        tmp_path,
        "strict",
        WEB_HEADER_TIMEOUT_S=str(HEADER_TIMEOUT_S),
        WEB_BODY_IDLE_TIMEOUT_S=str(BODY_IDLE_TIMEOUT_S),
        WEB_WRITE_TIMEOUT_S=str(WRITE_TIMEOUT_S),
    )
    try:
        yield url
    finally:
        _stop(web)


@pytest.fixture
def crowded(stack, tmp_path) -> Iterator[str]:
    """A web process with small connection limits (and the default header timeout, 10 s)."""
    url, web = _server(
        stack,
        tmp_path,
        "crowded",
        WEB_MAX_CONNECTIONS_PER_ADDRESS=str(PER_ADDRESS),
        WEB_MAX_CONNECTIONS=str(PER_PROCESS),
    )
    try:
        yield url
    finally:
        _stop(web)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _connect(url: str, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", _port(url)), timeout=10, source_address=(source, 0))


def _read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    try:
        while piece := sock.recv(65536):
            data += piece
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def _health_ok(url: str, source: str = "127.0.0.1") -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", _port(url), timeout=5, source_address=(source, 0))
    try:
        conn.request("GET", "/api/v1/health")
        return conn.getresponse().status == 200
    finally:
        conn.close()


def test_a_connection_that_never_finishes_its_headers_gets_408_and_is_closed(strict):
    sock = _connect(strict)
    started = time.monotonic()
    sock.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    answer = _read_until_closed(sock, timeout_s=15)
    waited_s = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"header_timeout" in answer
    assert HEADER_TIMEOUT_S * 0.8 <= waited_s < HEADER_TIMEOUT_S + 5, waited_s


def test_a_connection_that_sends_nothing_is_closed(strict):
    sock = _connect(strict)
    started = time.monotonic()
    _read_until_closed(sock, timeout_s=15)
    assert time.monotonic() - started < HEADER_TIMEOUT_S + 5, "the server kept a silent connection open"


def test_headers_sent_a_byte_at_a_time_are_cut_at_the_header_deadline(strict):
    """Slowloris: each byte arrives well within any per-read timeout, but the headers never end."""
    sock = _connect(strict)
    sock.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    started = time.monotonic()
    answer = None
    sock.settimeout(0.2)
    while answer is None and time.monotonic() - started < HEADER_TIMEOUT_S + 5:
        try:
            sock.sendall(b"X-a: b\r\n")
            answer = sock.recv(4096)  # the server's answer, or b"" once it closed
        except TimeoutError:
            continue
        except OSError:
            answer = b"reset"
    assert answer is not None, "the server still read a request whose headers never ended"
    assert answer.startswith(b"HTTP/1.1 408") or answer in (b"", b"reset"), answer[:200]


def test_a_kept_alive_connection_fed_blank_lines_is_closed(strict):
    """After one answer, bytes that never start a request (blank lines) must not hold the connection."""
    sock = _connect(strict)
    sock.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    sock.settimeout(5)
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    started = time.monotonic()
    closed = False
    sock.settimeout(0.3)
    while not closed and time.monotonic() - started < HEADER_TIMEOUT_S + 10:
        try:
            sock.sendall(b"\r\n")  # every 0.3 s: well within keep-alive's 5 s idle timeout
            sock.recv(4096)  # the 408, or b"" once closed: either way the server ended it
            closed = True
        except TimeoutError:
            continue
        except OSError:
            closed = True
    assert closed, "a connection fed blank lines stayed open"


def test_a_body_that_stops_arriving_is_given_up(strict):
    sock = _connect(strict)
    body = b'{"inputs": ["hello"]}'
    head = "POST /api/v1/models/router/predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(body) + 1000}\r\n\r\n".encode() + body)
    started = time.monotonic()
    _read_until_closed(sock, timeout_s=BODY_IDLE_TIMEOUT_S + 10)
    assert time.monotonic() - started < BODY_IDLE_TIMEOUT_S + 5, "the server waited on a body that stopped"


def test_a_body_that_keeps_arriving_slowly_is_not_cut(strict):
    """The body timeout is for a body that stops, not for a slow one: each piece re-arms it."""
    sock = _connect(strict)
    head = "POST /api/v1/models/router/predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    body = b'{"inputs": ["hello"]}'
    sock.sendall(f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
    for i in range(0, len(body), 7):  # three pieces, BODY_IDLE_TIMEOUT_S * 0.6 apart: 2.4 s in all
        sock.sendall(body[i : i + 7])
        time.sleep(BODY_IDLE_TIMEOUT_S * 0.6)
    answer = _read_until_closed(sock, timeout_s=15)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]  # read whole, then refused: no credentials


def test_a_body_trickled_a_byte_at_a_time_is_cut_by_the_minimum_rate(strict):
    """One byte a second never leaves the body idle for BODY_IDLE_TIMEOUT_S, yet must not hold the
    connection for ever: past the idle timeout a body must average WEB_MIN_BODY_BYTES_PER_S (500)."""
    sock = _connect(strict)
    head = "POST /api/v1/models/router/predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: 100000\r\n\r\n".encode())
    started = time.monotonic()
    closed = False
    while not closed and time.monotonic() - started < BODY_IDLE_TIMEOUT_S + 15:
        try:
            sock.sendall(b"a")
            time.sleep(0.5)  # the attacker's pace: well within the idle timeout
        except OSError:
            closed = True
    assert closed, "a body trickled at 2 bytes a second held its connection"
    assert time.monotonic() - started < BODY_IDLE_TIMEOUT_S + 6


def test_an_unfinished_trailer_is_bounded_as_headers_are(strict):
    """After a chunked body's last chunk, a trailer that never ends was kept in memory without limit."""
    sock = _connect(strict)
    head = "POST /api/v1/models/router/predict HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
    sock.sendall(f"{head}Content-Type: application/json\r\n\r\n".encode() + b"1\r\na\r\n0\r\nX-Trailer: ")
    sent = 0
    try:
        while sent < 64 * 1024 * 1024:
            sock.sendall(b"a" * 65536)
            sent += 65536
    except OSError:
        pass
    assert sent < 16 * 1024 * 1024, f"the server read {sent} bytes of one trailer"


def test_a_pipelined_flood_is_cut_after_a_few_requests(strict):
    """Requests sent ahead without reading the answers: a few are served, a flood closes the connection."""
    sock = _connect(strict)
    request = b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    try:
        sock.sendall(request * 2000)
    except OSError:
        pass
    answers = _read_until_closed(sock, timeout_s=15)  # closed: this returns
    assert answers.count(b"HTTP/1.1 200") <= 16


def test_a_few_pipelined_requests_are_all_answered(strict):
    sock = _connect(strict)
    request = b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    sock.sendall(request * 4 + b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert _read_until_closed(sock, timeout_s=15).count(b"HTTP/1.1 200") == 5


def _server_side_open(sock: socket.socket) -> bool:
    """Whether the server process still holds its end of this connection: /proc/net/tcp by the ports,
    with an inode (a socket the process closed may linger in the kernel, orphaned, with inode 0)."""
    local_port = sock.getsockname()[1]
    server_port = sock.getpeername()[1]
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, inode = fields[1], fields[2], fields[9]
        if int(local.split(":")[1], 16) == server_port and int(remote.split(":")[1], 16) == local_port:
            return inode != "0"
    return False


def test_a_client_that_never_reads_its_answer_is_disconnected(strict):
    """Answers larger than the kernel's buffers, to a client that reads nothing (a tiny receive window):
    the server's send waited for ever, and the connection was held with them."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", _port(strict)))
    sock.sendall(f"GET {BIG_STATIC} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode() * 6)  # about 9 MB of answers
    wait_until(lambda: not _server_side_open(sock), WRITE_TIMEOUT_S + 10, "the server to give up the unread answer")


def test_a_stray_byte_while_an_answer_is_sent_does_not_turn_it_into_a_408(strict):
    """Bytes after a request, while its answer is still being written (here: read slowly), must not start
    the header clock: a 408 used to land after (or in) the answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.connect(("127.0.0.1", _port(strict)))
    sock.sendall(f"GET {BIG_STATIC} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    sock.sendall(b"\r\n")
    time.sleep(HEADER_TIMEOUT_S * 2.5)  # longer than the header timeout (plus its sweep), shorter than the write one
    answer = _read_until_closed(sock, timeout_s=30)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    assert len(body) == length and b"HTTP/1.1 408" not in body[-300:]


def test_a_websocket_upgrade_does_not_keep_its_connection_slot(crowded):
    """An upgrade used to hand the connection to uvicorn's WebSocket protocol, which never gave back its
    slot: PER_ADDRESS upgrades locked the address out until a restart."""
    for _ in range(PER_ADDRESS + 5):
        sock = _connect(crowded, "127.0.0.9")
        sock.sendall(
            b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nConnection: close\r\n\r\n"
        )
        _read_until_closed(sock, timeout_s=10)
        sock.close()
    wait_until(lambda: _health_ok(crowded, "127.0.0.9"), 10, "the address to be served again")


def test_a_header_over_the_size_limit_gets_431_before_the_rest_is_read(stack):
    """On the stack's own server: 32 KiB of request line and headers by default."""
    sock = _connect(stack.url)
    sock.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
    sent = 0
    try:
        while sent < 64 * 1024 * 1024:  # 64 MB, if nothing stops it
            sock.sendall(b"a" * 65536)
            sent += 65536
    except OSError:
        pass
    answer = _read_until_closed(sock, timeout_s=10)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b"headers_too_large" in answer
    assert sent < 32 * 1024 * 1024, f"the server took {sent} bytes of one header"


def test_one_header_over_the_limit_in_a_single_read_gets_431(stack):
    sock = _connect(stack.url)
    sock.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n")
    answer = _read_until_closed(sock, timeout_s=10)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]


def test_twenty_thousand_headers_get_431(stack):
    sock = _connect(stack.url)
    head = "GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(f"X-{i}: v\r\n" for i in range(20_000))
    try:
        sock.sendall(head.encode() + b"\r\n")
    except OSError:
        pass
    answer = _read_until_closed(sock, timeout_s=10)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b"too_many_headers" in answer or b"headers_too_large" in answer


def test_ordinary_clients_are_untouched_by_the_limits(strict, stack):
    """Kept-alive connections idle between requests, and bodies far larger than the header limit."""
    with requests.Session() as session:
        for _ in range(3):
            assert session.get(f"{strict}/api/v1/health", timeout=5).status_code == 200
            time.sleep(HEADER_TIMEOUT_S * 1.5)  # idle longer than the header timeout, within keep-alive
    body = json.dumps({"inputs": ["x" * 100] * 5000}).encode()  # 0.5 MB, read with the headers in one go
    answer = requests.post(
        f"{stack.url}/api/v1/models/router/predict",
        data=body,
        headers={"Authorization": f"Token {stack.token}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert answer.status_code not in (408, 431), answer.text[:300]


def _open(url: str, source: str, n: int) -> tuple[list[socket.socket], list[bytes]]:
    """n connections from `source`, opened at once: those held, and the refusals the server wrote at once."""
    socks = [_connect(url, source) for _ in range(n)]
    readable: set[socket.socket] = set()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # a refusal is written on accept; give the server a moment
        ready, _, _ = select.select([s for s in socks if s not in readable], [], [], 0.1)
        readable.update(ready)
    refusals = []
    for sock in readable:
        refusals.append(sock.recv(4096))
        sock.close()
    return [s for s in socks if s not in readable], refusals


def test_one_address_holds_at_most_its_share_of_connections_and_others_are_served(crowded):
    held, refusals = _open(crowded, "127.0.0.2", PER_ADDRESS + 10)
    try:
        assert len(held) == PER_ADDRESS
        assert len(refusals) == 10
        assert all(r.startswith(b"HTTP/1.1 429") and b"too_many_connections" in r for r in refusals), refusals[0]
        assert b"retry-after: 1" in refusals[0].lower()
        assert _health_ok(crowded, "127.0.0.1"), "another address was refused while one address flooded"
    finally:
        for sock in held:
            sock.close()


def test_at_the_process_limit_a_newcomer_takes_an_idle_slot_of_the_biggest_holder(crowded):
    """Many addresses fill the process: a client with no connection is still served, at the cost of an
    idle connection of the address holding the most; the process never holds more than its limit."""
    held: list[socket.socket] = []
    try:
        for source, n in (("127.0.0.3", PER_ADDRESS), ("127.0.0.4", PER_ADDRESS), ("127.0.0.5", 10)):
            more, refused = _open(crowded, source, n)
            assert not refused, refused[:1]
            held += more
        assert len(held) == PER_PROCESS
        assert _health_ok(crowded, "127.0.0.6"), "a newcomer was refused while idle connections held the process"
        evicted: set[socket.socket] = set()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            evicted.update(select.select(held, [], [], 0.1)[0])
        evicted = list(evicted)
        assert len(evicted) == 1, len(evicted)
        answer = evicted[0].recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer, answer[:200]
        assert evicted[0].getsockname()[0] in ("127.0.0.3", "127.0.0.4"), "the evicted one was not the biggest holder's"
        # The biggest holders cannot take a slot from the others: their newcomers are refused.
        _, refused = _open(crowded, "127.0.0.5", 1)
        assert not refused  # 10 held, fewer than the top: it may take an idle slot of the top holder
        _, refused = _open(crowded, "127.0.0.3", 1)
        assert refused and refused[0].startswith((b"HTTP/1.1 503", b"HTTP/1.1 429")), refused
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: _health_ok(crowded), 10, "the server to serve again once the connections closed")


def _bad_token(url: str, source: str, forwarded_for: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", _port(url), timeout=5, source_address=(source, 0))
    try:
        conn.request(
            "GET", "/api/v1/jobs", headers={"Authorization": "Token " + "0" * 40, "X-Forwarded-For": forwarded_for}
        )
        answer = conn.getresponse()
        return answer.status, answer.read().decode()
    finally:
        conn.close()


def _flush_failures(redis_client) -> None:
    """The failure counters of the database these servers use (12), from earlier tests in this module."""
    where = redis_client.connection_pool.connection_kwargs
    client = redis.Redis(host=where["host"], port=where["port"], db=12)
    for key in client.scan_iter("auth:failures:*"):
        client.delete(key)


def test_x_forwarded_for_from_an_untrusted_client_is_ignored(stack, tmp_path, redis_client):
    """No proxy configured: rotating X-Forwarded-For does not get a guesser fresh attempts, not even from
    127.0.0.1 (which uvicorn's own default believes)."""
    _flush_failures(redis_client)
    url, web = _server(stack, tmp_path, "no-proxy")
    try:
        answers = [_bad_token(url, "127.0.0.1", f"203.0.113.{i}") for i in range(AUTH_FAILURES + 2)]
        assert answers[-1][0] == 429, answers
        assert "127.0.0.1" in answers[-1][1] and "203.0.113" not in answers[-1][1]
    finally:
        _stop(web)


def test_x_forwarded_for_is_believed_only_from_the_configured_proxy(stack, tmp_path, redis_client):
    _flush_failures(redis_client)
    url, web = _server(stack, tmp_path, "behind-proxy", FORWARDED_ALLOW_IPS="127.0.0.7")
    try:
        answers = [_bad_token(url, "127.0.0.7", "198.51.100.7") for _ in range(AUTH_FAILURES + 1)]
        assert answers[-1][0] == 429 and "198.51.100.7" in answers[-1][1], answers[-1]
        # Another client behind the same proxy is its own address, not locked out with the first.
        assert _bad_token(url, "127.0.0.7", "198.51.100.8")[0] == 401
        # A client that is not the proxy cannot claim to be someone else.
        status, body = _bad_token(url, "127.0.0.8", "198.51.100.9")
        assert status == 401
        for _ in range(AUTH_FAILURES):
            status, body = _bad_token(url, "127.0.0.8", "198.51.100.9")
        assert status == 429 and "127.0.0.8" in body, body
    finally:
        _stop(web)


def _pg_connections(conn, application_name: str) -> int:
    row = conn.execute("select count(*) from pg_stat_activity where application_name = %s", (application_name,))
    return int(row.fetchone()[0])


def test_a_burst_of_requests_borrows_at_most_the_pools_database_connections(stack, tmp_path):
    """150 concurrent sign-ins took PostgreSQL past max_connections (a connection per request): now a
    web process borrows at most WEB_DB_POOL_SIZE, the others wait their turn, and nobody gets a 500."""
    from concurrent.futures import ThreadPoolExecutor

    if "postgres" not in stack.env["DATABASE_URL"]:
        pytest.skip("the pool is PostgreSQL's")
    pool_size = 3
    url, web = _server(stack, tmp_path, "pooled", WEB_DB_POOL_SIZE=str(pool_size), AUTH_FAILURES_PER_WINDOW="0")
    name = f"platform-web:{web.pid}"
    stop, most = False, [0]

    def watch() -> None:
        import psycopg

        from tests.conftest import database_url

        with psycopg.connect(database_url(), autocommit=True) as conn:
            while not stop:
                most[0] = max(most[0], _pg_connections(conn, name))

    def pages(_: int) -> int:
        return requests.get(f"{url}/accounts/login/", timeout=60).status_code  # a session: a query or two

    def jobs(_: int) -> int:
        return requests.get(f"{url}/api/v1/jobs", headers=stack.headers(), timeout=60).status_code

    try:
        with ThreadPoolExecutor(1) as watcher, ThreadPoolExecutor(40) as pool:
            watching = watcher.submit(watch)
            statuses = list(pool.map(jobs, range(120))) + list(pool.map(pages, range(40)))
            stop = True
            watching.result()
        assert set(statuses) <= {200, 503}, statuses
        assert statuses.count(200) >= len(statuses) // 2
        assert 1 <= most[0] <= pool_size, most[0]
    finally:
        _stop(web)


def test_a_database_that_cannot_be_reached_gets_503_not_500(stack, tmp_path):
    """API paths answer JSON 503 database_unavailable (OpenAI's shape on /v1/), pages a styled 503, both
    with Retry-After; before, a plain 500."""
    port = free_port()
    env = {**stack.env, "DATABASE_URL": "postgres://postgres@127.0.0.1:9/nowhere", "WEB_DB_POOL_TIMEOUT_S": "2"}
    log = tmp_path / "no-db.log"
    web = _start([sys.executable, "-m", "platform_.server", "--port", str(port)], env, log)
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            try:
                return _health_ok(url)
            except OSError:
                return False

        wait_until(up, 60, "the web process without a database")
        api = requests.get(f"{url}/api/v1/jobs", headers=stack.headers(), timeout=30)
        assert api.status_code == 503 and api.json()["code"] == "database_unavailable", api.text[:300]
        assert int(api.headers["Retry-After"]) > 0
        openai = requests.get(f"{url}/v1/batches", headers=stack.headers(), timeout=30)
        assert openai.status_code == 503 and openai.json()["error"]["code"] == "database_unavailable"
        session = requests.Session()
        login = f"{url}/accounts/login/"
        session.get(login, timeout=30)
        page = session.post(
            login,
            data={"username": "tester", "password": "x", "csrfmiddlewaretoken": session.cookies["csrftoken"]},
            headers={"Referer": login},
            timeout=30,
        )
        assert page.status_code == 503 and "database is busy or unreachable" in page.text
    finally:
        _stop(web)
