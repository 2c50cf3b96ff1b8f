"""The real nginx (Debian's package) with the shipped configuration (deploy/nginx/) in front of the live
stack: slow and churning clients leave another client's requests fast, per-address limits answer 429 JSON
with Retry-After, the client's X-Forwarded-For never reaches the web, and bodies are limited per path.

The web behind nginx here is a web process of this module's own, on the stack's database, Redis and
workers, that trusts the proxy (FORWARDED_ALLOW_IPS=127.0.0.3, the address nginx connects from) and
writes an access log, so the address it believes can be read back. Every client binds a loopback
address of its own (127.0.0.x), so nginx's per-address limits see one client per test. nginx's limits are
the shipped defaults (benchmarks/nginx_front.py DEFAULTS) except the body sizes, scaled to the stack's
upload limit (JOBS_MAX_UPLOAD_BYTES=300000).
"""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from benchmarks import nginx_front
from benchmarks.edge_attacks import Victim, churn, slowloris_bytes, victim_loop
from tests.conftest import _start, _stop, free_port, wait_until

pytestmark = pytest.mark.integration

PROXY_ADDRESS = "127.0.0.3"  # nginx connects to the web from here; the web trusts only it
VICTIM_INTERVAL_S = 0.03  # ~33 requests a second, under the per-address rate (50/s)
P99_BOUND_MS = 1000.0
PREDICT_MAX_BODY = 64 * 1024


@dataclass
class Front:
    url: str  # nginx
    web_url: str  # the web process behind it, reached directly
    web_log: Path
    nginx: nginx_front.RunningNginx


def _source_session(address: str) -> requests.Session:
    """A requests session whose connections come from `address` (one client of nginx's limits)."""
    from requests.adapters import HTTPAdapter

    class Bound(HTTPAdapter):
        def init_poolmanager(self, *args, **kwargs):
            kwargs["source_address"] = (address, 0)
            super().init_poolmanager(*args, **kwargs)

    session = requests.Session()
    session.mount("http://", Bound())
    return session


@pytest.fixture(scope="module")
def front(stack, tmp_path_factory) -> Iterator[Front]:
    if not nginx_front.NGINX_BINARY.exists():
        pytest.skip("nginx is not installed (/usr/sbin/nginx): apt-get install nginx (.ci/run installs it)")
    folder = tmp_path_factory.mktemp("nginx")
    web_port, nginx_port = free_port(), free_port()
    web_log = folder / "web.log"
    env = {**stack.env, "FORWARDED_ALLOW_IPS": PROXY_ADDRESS}
    command = [sys.executable, "-m", "platform_.server", "--host", "127.0.0.1", "--port", str(web_port)]
    web = _start([*command, "--workers", "1", "--access-log"], env, web_log)
    web_url = f"http://127.0.0.1:{web_port}"

    def web_answers() -> bool:
        if web.poll() is not None:
            raise RuntimeError(f"the web process exited:\n{web_log.read_text()[-4000:]}")
        try:
            return requests.get(f"{web_url}/api/v1/health", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    try:
        wait_until(web_answers, 60, "the proxied web process")
        values = {
            **nginx_front.DEFAULTS,
            "NGINX_PORT": str(nginx_port),
            "NGINX_UPSTREAM": f"127.0.0.1:{web_port}",
            "NGINX_MAX_BODY": "256k",
            "NGINX_PREDICT_MAX_BODY": str(PREDICT_MAX_BODY),
            "NGINX_UPLOAD_MAX_BODY": "2m",
        }
        # free_port() only finds a port free at that moment: one in the ephemeral range can be taken by an
        # outgoing connection before nginx binds it (seen in CI: "Address already in use"). Another port then.
        for attempt in range(5):
            try:
                running = nginx_front.start(folder, values, proxy_bind=PROXY_ADDRESS)
                break
            except RuntimeError as error:
                if "Address already in use" not in str(error) or attempt == 4:
                    raise
                values["NGINX_PORT"] = str(free_port())
    except Exception:
        _stop(web)
        raise
    yield Front(running.url, web_url, web_log, running)
    running.stop()
    _stop(web)


def p99_ms(victim: Victim) -> float:
    ok = sorted(victim.latencies_ms)
    return ok[min(len(ok) - 1, int(len(ok) * 0.99))]


def under_attack(front: Front, attack, seconds: float, **kwargs) -> tuple[Victim, dict]:
    """Run `attack` against nginx for `seconds` while another client (127.0.0.1) calls GET /api/v1/health
    on a new connection every 30 ms; the other client's latencies and the attacker's report."""
    port = int(front.url.rsplit(":", 1)[1])
    stop, victim, report = threading.Event(), Victim(), {}
    attacker = threading.Thread(target=attack, args=("127.0.0.1", port, *kwargs.values(), stop, report))
    attacker.start()
    watcher = threading.Thread(target=victim_loop, args=("127.0.0.1", port, stop, victim, VICTIM_INTERVAL_S))
    watcher.start()
    stop.wait(seconds)
    stop.set()
    attacker.join(timeout=30)
    watcher.join(timeout=30)
    return victim, report


def test_a_slowloris_client_holding_500_connections_leaves_another_clients_requests_fast(front):
    victim, report = under_attack(front, slowloris_bytes, 12, source="127.0.0.2", n=500)
    # The attack happened as described: 500 connections held at once, headers a byte a second, and
    # nginx cut them at its header timeout (10 s, one clock from the first byte, not reset by each byte).
    assert report["held_max"] == 500, report
    assert report["closed_by_server"] >= 500 and 9 <= report["first_closed_s"] <= 12, report
    assert victim.failures == 0, victim.summary()
    assert len(victim.latencies_ms) >= 200, victim.summary()
    assert p99_ms(victim) < P99_BOUND_MS, victim.summary()


def test_a_flood_of_400_connections_a_second_that_hang_up_leaves_another_clients_requests_fast(front, stack):
    victim, report = under_attack(
        front, churn, 10, source="127.0.0.6", rate=400, token=stack.third_token, model="identity"
    )
    # A loaded 2-core machine may not reach 400 a second from one Python process; 300 is the floor
    # this test accepts as "the flood".
    assert report["per_s"] >= 300 and report["connect_failed"] == 0, report
    assert victim.failures == 0, victim.summary()
    assert len(victim.latencies_ms) >= 200, victim.summary()
    assert p99_ms(victim) < P99_BOUND_MS, victim.summary()


def test_per_address_request_rate_is_answered_429_json_with_retry_after(front):
    # Burst 100, then 50 a second: eight clients on one address, each sending as fast as it is answered,
    # pass that on any machine (a client alone, on a loaded one, might not outpace 50 a second).
    statuses: list[int] = []
    refused: list[requests.Response] = []

    def one_client() -> None:
        client = _source_session("127.0.0.4")
        for _ in range(150):
            if refused:
                return
            answer = client.get(f"{front.url}/api/v1/health", timeout=10)
            statuses.append(answer.status_code)
            if answer.status_code == 429:
                refused.append(answer)

    clients = [threading.Thread(target=one_client) for _ in range(8)]
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    assert statuses.count(200) >= 100 and refused, statuses
    answer = refused[0]
    assert answer.headers["Content-Type"] == "application/json"
    assert int(answer.headers["Retry-After"]) >= 1
    assert answer.json()["code"] == "rate_limited"
    # Another address is not limited by this one's flood.
    assert _source_session("127.0.0.8").get(f"{front.url}/api/v1/health", timeout=10).status_code == 200


def test_per_address_connections_past_the_limit_are_answered_429_json(front):
    """64 requests in progress from one address (bodies promised and not sent); the 65th is refused."""
    port = int(front.url.rsplit(":", 1)[1])
    head = "POST /api/v1/models/identity/predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    held: list[socket.socket] = []

    def hold_another() -> None:
        conn = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.9", 0))
        conn.sendall(head.encode())
        held.append(conn)

    def top_up() -> None:
        """Replace held requests nginx has answered. sendall returns before nginx reads the headers, so
        the extra client's request can be counted first, and then the 64th held one is the one refused
        (seen here and in CI: 63 held, and every extra request served)."""
        answered, _, _ = select.select(held, [], [], 0)
        for conn in answered:
            held.remove(conn)
            conn.close()
            hold_another()

    try:
        for _ in range(int(nginx_front.DEFAULTS["NGINX_CONNECTIONS_PER_ADDRESS"])):
            hold_another()
        extra = _source_session("127.0.0.9")
        seen: list[str] = []  # what the extra client got meanwhile, for the failure message

        def refused() -> list[requests.Response]:
            top_up()
            try:
                answer = extra.get(f"{front.url}/api/v1/health", timeout=10)
            except requests.RequestException as error:
                seen.append(type(error).__name__)
                return []
            seen.append(str(answer.status_code))
            return [answer] if answer.status_code == 429 else []  # a 429 Response is falsy itself

        try:
            (answer,) = wait_until(refused, 10, "a 429 for the connection over the limit")
        except TimeoutError:
            log = front.nginx.error_log()[-3000:]
            access = (front.nginx.folder / "access.log").read_text()[-3000:]
            raise AssertionError(f"answers seen: {seen}\nnginx error log:\n{log}\naccess log:\n{access}") from None
        assert answer.json()["code"] == "rate_limited" and answer.headers["Retry-After"] == "1"
    finally:
        for conn in held:
            conn.close()
    # Once they are closed, the address is served again.
    wait_until(
        lambda: _source_session("127.0.0.9").get(f"{front.url}/api/v1/health", timeout=10).status_code == 200,
        10,
        "the address served again",
    )


def test_a_clients_x_forwarded_for_is_replaced_by_its_own_address(front):
    marker = uuid.uuid4().hex
    client = _source_session("127.0.0.5")
    answer = client.get(
        f"{front.url}/api/v1/health?probe={marker}",
        headers={"X-Forwarded-For": "203.0.113.9", "X-Forwarded-Proto": "https"},
        timeout=10,
    )
    assert answer.status_code == 200
    # The same claim sent to the web directly, from an address it does not trust, is ignored too.
    direct = requests.get(
        f"{front.web_url}/api/v1/health?probe=direct-{marker}", headers={"X-Forwarded-For": "203.0.113.9"}, timeout=10
    )
    assert direct.status_code == 200

    def logged(probe: str) -> str | None:
        return next((line for line in front.web_log.read_text().splitlines() if f"probe={probe}" in line), None)

    line = wait_until(lambda: logged(marker), 10, "the proxied request in the web's access log")
    assert "127.0.0.5" in line and "203.0.113.9" not in line, line
    line = wait_until(lambda: logged(f"direct-{marker}"), 10, "the direct request in the web's access log")
    assert "127.0.0.1" in line and "203.0.113.9" not in line, line


def test_a_body_over_predicts_limit_is_refused_on_predict_and_accepted_as_an_upload(front, stack):
    texts = [f"ticket {i}: my parcel never arrived and nobody answers my emails" for i in range(2000)]
    body = json.dumps({"inputs": texts}).encode()
    assert len(body) > PREDICT_MAX_BODY
    client = _source_session("127.0.0.7")
    predict = client.post(
        f"{front.url}/api/v1/models/identity/predict",
        data=body,
        headers={**stack.headers(), "Content-Type": "application/json"},
        timeout=30,
    )
    assert predict.status_code == 413
    assert predict.headers["Content-Type"] == "application/json"
    assert predict.json()["code"] == "payload_too_large"

    csv = ("text\n" + "\n".join(texts)).encode()
    assert len(csv) > PREDICT_MAX_BODY
    upload = client.post(
        f"{front.url}/api/v1/jobs",
        files={"file": ("tickets.csv", csv, "text/csv")},
        data={"model": "router", "text_column": "text"},
        headers=stack.headers(),
        timeout=60,
    )
    assert upload.status_code == 202, upload.text
    assert upload.json()["upload_bytes"] > PREDICT_MAX_BODY
