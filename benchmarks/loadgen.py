"""Load generators shared by the benchmarks: closed loop (N clients back to back) and open loop (a fixed arrival rate).

Payloads are drawn at random from benchmarks/corpus.txt (72 texts of 2 to 153 words): one repeated
payload would flatter the result, as the article warns. The generator measures its own CPU so a
report can say when the generator, not the server, was the limit.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
CORPUS = [line for line in (HERE / "corpus.txt").read_text().splitlines() if line.strip()]


@dataclass
class Result:
    status: int  # 0: no HTTP answer (connection error or client timeout)
    latency_s: float
    batch_size: int = 0
    retry_after: str | None = None
    done_at: float = 0.0  # time.monotonic() when the answer came


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    client_cpu_pct: float = 0.0  # of one core: the generator is one event loop in one process

    def ok(self) -> list[float]:
        return [r.latency_s for r in self.results if r.status == 200]

    def count(self, status: int) -> int:
        return sum(1 for r in self.results if r.status == status)

    def qps(self) -> float:
        return len(self.ok()) / self.wall_s if self.wall_s else 0.0

    def percentile_ms(self, pct: float) -> float | None:
        ok = sorted(self.ok())
        return ok[min(len(ok) - 1, int(round(pct / 100 * (len(ok) - 1))))] * 1000 if ok else None

    def mean_ms(self) -> float | None:
        ok = self.ok()
        return statistics.mean(ok) * 1000 if ok else None

    def mean_batch(self) -> float | None:
        sizes = [r.batch_size for r in self.results if r.status == 200 and r.batch_size]
        return statistics.mean(sizes) if sizes else None


class _Http:
    """A minimal HTTP/1.1 client on asyncio streams: keep-alive connections, one event loop, no threads.

    A thread per client (`requests`) cost about 1.5 ms of CPU per call and, at hundreds of threads in
    an open-loop overload, the generator's own GIL queue showed up as seconds of "latency". This one
    costs a fraction of that, so the machine's cores go to the system under test.
    """

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.head = f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{extra}"
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, text: str | list[str], timeout_s: float, extra_headers: str = "") -> Result:
        started = time.perf_counter()
        body = json.dumps({"inputs": [text] if isinstance(text, str) else text}).encode()
        head = self.head + extra_headers + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        request = head.encode() + body
        conn = None
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    reused = bool(self.idle)
                    conn = self.idle.pop() if reused else await asyncio.open_connection(self.host, self.port)
                    conn[1].write(request)
                    try:
                        status, headers, payload = await self._response(conn[0])
                        break
                    except (ConnectionError, asyncio.IncompleteReadError) as exc:
                        # The server closed an idle keep-alive connection: send again on another.
                        conn[1].close()
                        if not reused or getattr(exc, "partial", b""):
                            raise
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError):
            if conn:
                conn[1].close()
            return Result(0, time.perf_counter() - started, done_at=time.monotonic())
        latency = time.perf_counter() - started
        if headers.get("connection") == "close":
            conn[1].close()
        else:
            self.idle.append(conn)
        batch = 0
        if status == 200:
            try:
                batch = (json.loads(payload).get("timing") or {}).get("batch_size", 0)
            except (ValueError, AttributeError):
                batch = 0  # answered, but not with the platform's body (the naive server's has no timing)
        return Result(status, latency, batch, headers.get("retry-after"), time.monotonic())

    @staticmethod
    async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            return status, headers, await reader.readexactly(int(headers["content-length"]))
        if headers.get("transfer-encoding") != "chunked":
            raise ValueError("a response with neither Content-Length nor chunked framing")
        payload = b""
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            payload += (await reader.readexactly(size + 2))[:-2]
        await reader.readuntil(b"\r\n")
        return status, headers, payload

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


def _measured(body) -> Run:
    """Run the coroutine `body(run)` on a fresh event loop and account wall time and own CPU."""
    run = Run()
    cpu, started = time.process_time(), time.monotonic()
    asyncio.run(body(run))
    run.wall_s = time.monotonic() - started
    run.client_cpu_pct = (time.process_time() - cpu) / run.wall_s * 100
    return run


def closed_loop(
    url: str,
    headers: dict[str, str],
    clients: int,
    seconds: float,
    seed: int = 0,
    timeout_s: float = 30,
    honour_retry_after: bool = True,
) -> Run:
    """`clients` concurrent clients, each sending its next request as soon as the last one is answered.

    A client told 503 or 429 with Retry-After waits that long before its next request, as a
    well-behaved client does. `honour_retry_after=False` makes a retry storm: clients (and proxies)
    that resend at once, which the platform must survive too (benchmarks/fairness.py).
    """

    async def body(run: Run) -> None:
        http = _Http(url, headers)
        stop_at = time.monotonic() + seconds

        async def client(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < stop_at:
                result = await http.post(rng.choice(CORPUS), timeout_s)
                run.results.append(result)
                refused = result.status in (429, 503) and result.retry_after and result.retry_after.isdigit()
                if honour_retry_after and refused:
                    await asyncio.sleep(min(int(result.retry_after), max(0.0, stop_at - time.monotonic())))

        await asyncio.gather(*(client(i) for i in range(clients)))
        http.close()

    return _measured(body)


def open_loop(
    url: str, headers: dict[str, str], rate_per_s: float, seconds: float, seed: int = 0, timeout_s: float = 30
) -> Run:
    """Requests arrive at a fixed rate whatever the answers do: how overload really comes."""

    async def body(run: Run) -> None:
        http = _Http(url, headers)
        rng = random.Random(seed)
        started = time.monotonic()
        pending = set()

        async def one(text: str) -> None:
            run.results.append(await http.post(text, timeout_s))

        for i in range(int(rate_per_s * seconds)):
            delay = started + i / rate_per_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(rng.choice(CORPUS)))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)
        http.close()

    return _measured(body)
