"""Attacks on the web server itself, before any view runs, and what another client sees meanwhile.

    python -m benchmarks.edge_attacks --url http://127.0.0.1:8000 [--connections 5000] [--seconds 20]

Each attack runs on its own while a victim (another address: 127.0.0.1, the attacker binds
--attacker-address, 127.0.0.2 by default, both loopback) sends one GET /api/v1/health per 50 ms on a new
connection. Per attack: what the server did (status, when it closed), the victim's P50/P99 and its
failures, and the web processes' RSS (sum over the processes listening on the port, from /proc).

- idle: --connections connections that send nothing (and reconnect when the server closes them);
- slowloris: 500 connections that send one header line per second;
- slowloris-bytes: 500 connections that send their headers one byte per second each, and reopen any the
  server closes, so 500 are held throughout;
- churn: --churn-rate new connections a second (400 by default) that each send a predict call of 8 texts
  (--token, --model) and hang up at once, without reading the answer;
- big-header: 20 connections each sending a 40 MB header;
- many-headers: one request with 20,000 headers.

Loopback only (the attacker binds a second loopback address). Writes a table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse


@dataclass
class Victim:
    latencies_ms: list[float] = field(default_factory=list)
    failures: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        ok = sorted(self.latencies_ms)
        if not ok:
            return f"0 answered, {self.failures} failed {self.errors}"
        p99 = ok[min(len(ok) - 1, int(len(ok) * 0.99))]
        return (
            f"{len(ok)} answered, {self.failures} failed {self.errors or ''}, "
            f"P50 {statistics.median(ok):.1f} ms, P99 {p99:.1f} ms"
        )


def victim_loop(host: str, port: int, stop: threading.Event, out: Victim, interval_s: float = 0.05) -> None:
    request = f"GET /api/v1/health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
    while not stop.is_set():
        started = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=5, source_address=("127.0.0.1", 0)) as conn:
                conn.sendall(request)
                head = conn.recv(64)
            if not head.startswith(b"HTTP/1.1 200"):
                raise OSError(head[:20].decode(errors="replace") or "closed without an answer")
            out.latencies_ms.append((time.perf_counter() - started) * 1000)
        except OSError as error:
            out.failures += 1
            name = type(error).__name__ if not str(error).startswith("HTTP") else str(error)[:12]
            out.errors[name] = out.errors.get(name, 0) + 1
        stop.wait(max(0.0, interval_s - (time.perf_counter() - started)))


def web_rss_mb(port: int) -> float:
    """RSS of the processes that hold a listening socket on `port` (the web server and its workers)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(parts[9])
    total_kb = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = {Path(fd).readlink().name for fd in (proc / "fd").iterdir()}
        except OSError:
            continue
        if any(f"socket:[{inode}]" in fds for inode in inodes):
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
    return total_kb / 1024


def connect(host: str, port: int, source: str) -> socket.socket | None:
    try:
        return socket.create_connection((host, port), timeout=2, source_address=(source, 0))
    except OSError:
        return None


def idle_attack(host: str, port: int, source: str, n: int, stop: threading.Event, report: dict) -> None:
    held: list[socket.socket] = []
    opened = refused = 0
    while not stop.is_set():
        while len(held) < n and not stop.is_set():
            conn = connect(host, port, source)
            if conn is None:
                refused += 1
                break
            conn.setblocking(False)
            held.append(conn)
            opened += 1
        alive = []
        for conn in held:  # drop the ones the server closed, so they are opened again
            try:
                if conn.recv(4096) == b"":
                    conn.close()
                    continue
            except BlockingIOError:
                pass
            except OSError:
                conn.close()
                continue
            alive.append(conn)
        held = alive
        report["held_max"] = max(report.get("held_max", 0), len(held))
        stop.wait(0.2)
    report.update(opened=opened, connect_failed=refused)
    for conn in held:
        conn.close()


def slowloris(host: str, port: int, source: str, n: int, stop: threading.Event, report: dict) -> None:
    conns = [c for c in (connect(host, port, source) for _ in range(n)) if c is not None]
    started = time.monotonic()
    for conn in conns:
        conn.sendall(f"GET /api/v1/health HTTP/1.1\r\nHost: {host}\r\n".encode())
    closed_at: list[float] = []
    while not stop.is_set() and conns:
        alive = []
        for conn in conns:
            try:
                conn.sendall(b"X-a: b\r\n")
                alive.append(conn)
            except OSError:
                closed_at.append(time.monotonic() - started)
                conn.close()
        conns = alive
        stop.wait(1.0)
    report.update(
        opened=n, still_open_at_end=len(conns), first_closed_s=round(min(closed_at), 1) if closed_at else None
    )
    for conn in conns:
        conn.close()


def slowloris_bytes(host: str, port: int, source: str, n: int, stop: threading.Event, report: dict) -> None:
    """`n` connections whose headers arrive one byte per second each, reopened when the server closes one."""
    request = f"GET /api/v1/health HTTP/1.1\r\nHost: {host}\r\n" + "".join(f"X-{i}: {i}\r\n" for i in range(1000))
    payload = request.encode()
    conns: dict[socket.socket, int] = {}
    opened = closed_by_server = 0
    started = time.monotonic()
    first_closed_s: float | None = None
    while not stop.is_set():
        while len(conns) < n and not stop.is_set():
            conn = connect(host, port, source)
            if conn is None:
                report["connect_failed"] = report.get("connect_failed", 0) + 1
                break
            conn.setblocking(False)
            conns[conn] = 0
            opened += 1
        report["held_max"] = max(report.get("held_max", 0), len(conns))
        for conn, sent in list(conns.items()):
            try:
                conn.send(payload[sent : sent + 1])
                conns[conn] = sent + 1
                if conn.recv(4096) == b"":
                    raise ConnectionResetError
            except BlockingIOError:
                pass
            except OSError:
                closed_by_server += 1
                first_closed_s = first_closed_s or round(time.monotonic() - started, 1)
                del conns[conn]
                conn.close()
        stop.wait(1.0)
    report.update(opened=opened, closed_by_server=closed_by_server, first_closed_s=first_closed_s)
    for conn in conns:
        conn.close()


def churn(
    host: str, port: int, source: str, rate: float, token: str, model: str, stop: threading.Event, report: dict
) -> None:
    """`rate` new connections a second, each sending a predict call of 8 texts and hanging up at once.

    Four threads share the rate, so a connect that waits (a full accept queue) does not slow the rest.
    """
    body = json.dumps({"inputs": [f"my parcel number {i} never arrived" for i in range(8)]}).encode()
    request = (
        f"POST /api/v1/models/{model}/predict HTTP/1.1\r\nHost: {host}\r\nAuthorization: Token {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    counts = {"sent": 0, "connect_failed": 0}
    lock = threading.Lock()
    started = time.monotonic()

    def one_thread(share: float) -> None:
        next_at = time.monotonic()
        while not stop.is_set():
            next_at += 1 / share
            try:
                with socket.create_connection((host, port), timeout=2, source_address=(source, 0)) as conn:
                    conn.sendall(request)
                key = "sent"
            except OSError:
                key = "connect_failed"
            with lock:
                counts[key] += 1
            stop.wait(max(0.0, next_at - time.monotonic()))

    threads = [threading.Thread(target=one_thread, args=(rate / 4,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed_s = time.monotonic() - started
    report.update(counts, per_s=round(counts["sent"] / elapsed_s))


def send_header(host: str, port: int, source: str, size_bytes: int, report: dict, key: str) -> None:
    conn = connect(host, port, source)
    if conn is None:
        report[key] = "connect failed"
        return
    chunk = b"a" * 65536
    sent = 0
    conn.settimeout(30)
    try:
        conn.sendall(f"GET /api/v1/health HTTP/1.1\r\nHost: {host}\r\nX-Big: ".encode())
        while sent < size_bytes:
            conn.sendall(chunk)
            sent += len(chunk)
        conn.sendall(b"\r\n\r\n")
        answer = conn.recv(200)
        report[key] = answer.split(b"\r\n", 1)[0].decode(errors="replace") or "closed"
    except OSError as error:
        report[key] = type(error).__name__
        with contextlib.suppress(OSError):
            conn.settimeout(1)
            report[key] = conn.recv(200).split(b"\r\n", 1)[0].decode(errors="replace") or report[key]
    finally:
        # Sent into the socket, not necessarily read by the server (the kernel buffers a few MB).
        report["most_sent_kib"] = max(report.get("most_sent_kib", 0), sent >> 10)
        conn.close()


def big_headers(host: str, port: int, source: str, stop: threading.Event, report: dict) -> None:
    threads = [
        threading.Thread(target=send_header, args=(host, port, source, 40 << 20, report, f"conn{i}")) for i in range(20)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    answers: dict[str, int] = {}
    for i in range(20):
        answer = report.pop(f"conn{i}", "?")
        answers[answer] = answers.get(answer, 0) + 1
    report["answers"] = answers


def many_headers(host: str, port: int, source: str, stop: threading.Event, report: dict) -> None:
    conn = connect(host, port, source)
    if conn is None:
        report["answer"] = "connect failed"
        return
    try:
        head = f"GET /api/v1/health HTTP/1.1\r\nHost: {host}\r\n" + "".join(f"X-{i}: v\r\n" for i in range(20_000))
        conn.sendall(head.encode() + b"\r\n")
        conn.settimeout(10)
        report["answer"] = conn.recv(200).split(b"\r\n", 1)[0].decode(errors="replace")
    except OSError as error:
        report["answer"] = type(error).__name__
    finally:
        conn.close()


def settle(host: str, port: int, timeout_s: float = 60) -> None:
    """Wait until the server answers the other client's request within 50 ms five times in a row: an attack
    before (a flood's queued requests, still being answered) must not be counted against the next one."""
    deadline, fast = time.monotonic() + timeout_s, 0
    while fast < 5 and time.monotonic() < deadline:
        started = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=5) as conn:
                conn.sendall(f"GET /api/v1/health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
                ok = conn.recv(64).startswith(b"HTTP/1.1 200")
        except OSError:
            ok = False
        fast = fast + 1 if ok and time.perf_counter() - started < 0.05 else 0
        time.sleep(0.2)


def run(name: str, attack, url: str, seconds: float, **kwargs) -> None:
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    settle(host, port)
    stop, victim, report = threading.Event(), Victim(), {}
    rss_before = web_rss_mb(port)
    rss_peak = [rss_before]
    attacker = threading.Thread(target=attack, args=(host, port, kwargs.pop("source"), *kwargs.values(), stop, report))
    attacker.start()
    watcher = threading.Thread(target=victim_loop, args=(host, port, stop, victim))
    watcher.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rss_peak.append(web_rss_mb(port))
        time.sleep(0.5)
    stop.set()
    attacker.join()
    watcher.join()
    print(f"| {name} | {report} | {victim.summary()} | {rss_before:.0f} -> peak {max(rss_peak):.0f} MB |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--connections", type=int, default=5000)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--attacker-address", default="127.0.0.2")
    parser.add_argument("--attacks", default="idle,slowloris,big-header,many-headers")
    parser.add_argument("--churn-rate", type=float, default=400, help="new connections a second (churn)")
    parser.add_argument("--token", default="", help="the API token the churn's predict calls carry")
    parser.add_argument("--model", default="identity", help="the model the churn's predict calls name")
    args = parser.parse_args()
    source = args.attacker_address
    print(
        "| attack | what the attacker saw | another client (GET /api/v1/health, new connection per 50 ms) | web RSS |"
    )
    print("|---|---|---|---|")
    chosen = set(args.attacks.split(","))
    if "idle" in chosen:
        run(f"idle x{args.connections}", idle_attack, args.url, args.seconds, source=source, n=args.connections)
    if "slowloris" in chosen:
        run("slowloris x500", slowloris, args.url, args.seconds, source=source, n=500)
    if "slowloris-bytes" in chosen:
        run("slowloris x500, a byte a second", slowloris_bytes, args.url, args.seconds, source=source, n=500)
    if "churn" in chosen:
        run(
            f"churn {args.churn_rate:g}/s",
            churn,
            args.url,
            args.seconds,
            source=source,
            rate=args.churn_rate,
            token=args.token,
            model=args.model,
        )
    if "big-header" in chosen:
        run("40 MB header x20", big_headers, args.url, args.seconds, source=source)
    if "many-headers" in chosen:
        run("20,000 headers", many_headers, args.url, min(args.seconds, 5), source=source)


if __name__ == "__main__":
    main()
