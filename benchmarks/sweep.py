"""The article's concurrency sweep: the naive design vs the platform vs the model's own ceiling, one run.

    python -m benchmarks.sweep [--concurrency 1,2,4,8,16,32,40] [--seconds 30] [--scenarios overload,isolation]

Needs a running stack (`make run`). Starts the naive baseline itself (benchmarks/naive_server.py).
For each concurrency step: P50/P95/P99/mean, QPS, errors, 503, 504, CPU of the web and worker
processes (and, within the worker's, of the pool's children that run the model), the load generator's
own CPU, GPU use where nvidia-smi answers, mean batch size and queue depth (from the platform's metrics).
Writes benchmarks/out/sweep.md, sweep.csv and sweep.png; prints the targets met or missed as ratios.
The ratio of the peak to the ceiling is split into the children's CPU share and their efficiency per
CPU-second (`ceiling_gap`). Processes are found once, at the start: children forked later (autoscaling,
a replaced child) are not counted.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import redis
import requests

from benchmarks.ceiling import Ceiling, measure
from benchmarks.loadgen import CORPUS, HERE, Run, closed_loop, open_loop
from benchmarks.smoke import default_token
from benchmarks.upload import upload

OUT = HERE / "out"
GENERATOR_SATURATED_PCT = 85.0


@dataclass
class Step:
    system: str
    concurrency: int
    requests: int
    qps: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    errors: int
    refused_503: int
    timeouts_504: int
    server_cpu_pct: float
    worker_cpu_pct: float
    generator_cpu_pct: float
    mean_batch: float | None
    mean_queue_depth: float | None
    gpu_util_pct: float | None = None  # mean over the step; None where nvidia-smi does not answer
    # CPU of the online pool's children alone (the processes that run the model), within worker_cpu_pct.
    model_cpu_pct: float | None = None


class GpuSampler:
    """Samples GPU utilisation with nvidia-smi twice a second while a step runs (nothing without a GPU)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s, self.samples = interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout.split()
                values = [float(v) for v in out]
            except (OSError, ValueError, subprocess.SubprocessError):
                return
            if values:
                self.samples.append(sum(values) / len(values))

    def __enter__(self) -> GpuSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.available:
            self._thread.join(timeout=10)

    def mean(self) -> float | None:
        return round(sum(self.samples) / len(self.samples)) if self.samples else None


def processes(pattern: list[str]) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if all(p in cmd for p in pattern) and "benchmarks." not in cmd:
            found.append(proc)
    return found


def with_children(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes and all their descendants, each once (uvicorn's workers and Celery's pool are children)."""
    found: dict[int, psutil.Process] = {}
    for proc in procs:
        for member in [proc, *proc.children(recursive=True)]:
            found[member.pid] = member
    return list(found.values())


def pool_children(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Of a worker's processes (with_children), the pool's children: the leaves whose parent is among them
    (not the main process, nor a shell that started it, as Procfile does)."""
    parents: dict[int, int] = {}
    for proc in procs:
        try:
            parents[proc.pid] = proc.ppid()
        except psutil.Error:
            pass
    has_children = set(parents.values())
    return [p for p in procs if parents.get(p.pid) in parents and p.pid not in has_children]


@dataclass(frozen=True)
class CeilingGap:
    """Peak over the N-process ceiling, split in two factors whose product it is:

    - `cpu_share`: the CPU the model's processes got, over the N cores the ceiling's N processes had
      to themselves (the rest went to the web, the broker, the worker's main process, the load generator);
    - `efficiency`: texts per CPU-second in those processes, over the ceiling's own (batch shapes,
      per-pass overhead, caches shared with the rest).
    On a CPU host the first bounds the ratio whatever the batching does; on a GPU host the second is
    the one that matters."""

    ratio: float
    cpu_share: float
    efficiency: float


def ceiling_gap(qps: float, model_cpu_pct: float, ceiling_qps: float, processes: int) -> CeilingGap | None:
    if model_cpu_pct <= 0 or ceiling_qps <= 0 or processes <= 0:
        return None
    model_cores = model_cpu_pct / 100
    return CeilingGap(
        ratio=qps / ceiling_qps,
        cpu_share=model_cores / processes,
        efficiency=qps / (model_cores * ceiling_qps / processes),
    )


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def rss_mb(procs: list[psutil.Process]) -> dict[str, float]:
    out = {}
    for proc in procs:
        try:
            out[f"{proc.pid} {' '.join(proc.cmdline()[:4])[:60]}"] = proc.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return out


def queue_depth(client: redis.Redis | None, seconds: int) -> float | None:
    if client is None:
        return None
    from observability import metrics

    samples = [
        b["gauge|online|waiting"] + b.get("gauge|online|in_flight", 0.0)
        for b in metrics.read_seconds(client, seconds)
        if "gauge|online|waiting" in b
    ]
    return sum(samples) / len(samples) if samples else None


def stack_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a benchmark driving a running stack: where it is, which model, where the report goes."""
    parser.add_argument("--url", default=os.environ.get("PLATFORM_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--model", default="router")
    parser.add_argument(
        "--children", type=int, default=int(os.environ.get("ONLINE_CONCURRENCY", 2)), help="online worker children"
    )
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--out", default=str(OUT))


@dataclass
class Target:
    """The running stack a benchmark drives (from `stack_arguments`): its model's endpoint, its Redis, and
    its web and online worker processes (found once: see the module's docstring)."""

    out: Path
    token: str
    predict_url: str
    client: redis.Redis
    web: list[psutil.Process]
    workers: list[psutil.Process]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Token {self.token}"}

    @classmethod
    def of(cls, args: argparse.Namespace) -> Target:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings.local")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        return cls(
            out=out,
            token=default_token(),
            predict_url=f"{args.url}/api/v1/models/{args.model}/predict",
            client=redis.Redis.from_url(args.redis_url, decode_responses=True),
            web=with_children(processes(["-m platform_.server"])),
            workers=with_children(processes(["celery", "-Q online"])),
        )


def run_step(system, url, headers, concurrency, seconds, server_procs, worker_procs, client, seed) -> Step:
    model_procs = pool_children(worker_procs)
    server_before, worker_before = cpu_seconds(server_procs), cpu_seconds(worker_procs)
    model_before = cpu_seconds(model_procs)
    with GpuSampler() as gpu:
        run = closed_loop(url, headers, concurrency, seconds, seed=seed)
    server_cpu = (cpu_seconds(server_procs) - server_before) / run.wall_s * 100
    worker_cpu = (cpu_seconds(worker_procs) - worker_before) / run.wall_s * 100
    model_cpu = (cpu_seconds(model_procs) - model_before) / run.wall_s * 100 if model_procs else None
    return Step(
        system=system,
        concurrency=concurrency,
        requests=len(run.results),
        qps=round(run.qps(), 1),
        p50_ms=run.percentile_ms(50),
        p95_ms=run.percentile_ms(95),
        p99_ms=run.percentile_ms(99),
        mean_ms=run.mean_ms(),
        errors=run.count(0) + sum(1 for r in run.results if r.status not in (0, 200, 503, 504)),
        refused_503=run.count(503),
        timeouts_504=run.count(504),
        server_cpu_pct=round(server_cpu),
        worker_cpu_pct=round(worker_cpu),
        generator_cpu_pct=round(run.client_cpu_pct),
        mean_batch=run.mean_batch(),
        mean_queue_depth=queue_depth(client, int(seconds)),
        gpu_util_pct=gpu.mean(),
        model_cpu_pct=None if model_cpu is None else round(model_cpu),
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_naive(model: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.naive_server", "--port", str(port), "--model", model],
        cwd=HERE.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if requests.get(base, timeout=1).status_code == 200:
                return proc, f"{base}/predict"
        except requests.RequestException:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the naive server did not start")


def fmt(value, digits=0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def table(steps: list[Step]) -> str:
    head = "| system | conc. | QPS | P50 ms | P95 ms | P99 ms | mean ms | err | 503 | 504 | server CPU % | worker CPU % | of it, model CPU % | generator CPU % | GPU % | mean batch | queue depth |"
    lines = [head, "|" + "---|" * 17]
    for s in steps:
        flag = " (saturated)" if s.generator_cpu_pct >= GENERATOR_SATURATED_PCT else ""
        lines.append(
            f"| {s.system} | {s.concurrency} | {s.qps:.1f} | {fmt(s.p50_ms)} | {fmt(s.p95_ms)} | {fmt(s.p99_ms)} | "
            f"{fmt(s.mean_ms)} | {s.errors} | {s.refused_503} | {s.timeouts_504} | {s.server_cpu_pct} | "
            f"{s.worker_cpu_pct} | {fmt(s.model_cpu_pct)} | {s.generator_cpu_pct}{flag} | {fmt(s.gpu_util_pct)} | {fmt(s.mean_batch, 2)} | "
            f"{fmt(s.mean_queue_depth, 1)} |"
        )
    return "\n".join(lines)


def chart(steps: list[Step], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, thr) = plt.subplots(1, 2, figsize=(12, 4.5))
    for system, color in (("naive", "#c33"), ("platform", "#36c")):
        rows = [s for s in steps if s.system == system]
        if not rows:
            continue
        x = [s.concurrency for s in rows]
        lat.plot(x, [s.p50_ms for s in rows], "-o", color=color, label=f"{system} P50")
        lat.plot(x, [s.p99_ms for s in rows], "--o", color=color, label=f"{system} P99")
        thr.plot(x, [s.qps for s in rows], "-o", color=color, label=system)
    lat.set(xlabel="concurrent clients", ylabel="latency (ms)", title="Latency", yscale="log")
    thr.set(xlabel="concurrent clients", ylabel="answered requests/s", title="Throughput")
    lat.legend()
    thr.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def overload(url, headers, capacity_qps, seconds, procs) -> dict:
    rate = 3 * capacity_qps
    memory_start = rss_mb(procs)
    run: Run = open_loop(url, headers, rate, seconds)
    accepted = [r for r in run.results if r.status == 200]
    refused = [r for r in run.results if r.status == 503]
    other = [r for r in run.results if r.status not in (200, 503)]
    return {
        "arrival_rate_per_s": round(rate, 1),
        "seconds": seconds,
        "goodput_qps": round(len(accepted) / run.wall_s, 1),
        "accepted_p99_ms": run.percentile_ms(99),
        "refused_503": len(refused),
        "refused_with_retry_after": sum(1 for r in refused if r.retry_after),
        "other_statuses": {str(s): sum(1 for r in other if r.status == s) for s in sorted({r.status for r in other})},
        "generator_cpu_pct": round(run.client_cpu_pct),
        "memory_mb_start": memory_start,
        "memory_mb_end": rss_mb(procs),
    }


def isolation(url, headers, capacity_qps, seconds, base_url, token) -> dict:
    rate = capacity_qps / 2
    alone = open_loop(url, headers, rate, seconds, seed=1)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["id", "text"])
    writer.writerows([f"r{i}", CORPUS[i % len(CORPUS)]] for i in range(20_000))
    data = buffer.getvalue().encode()
    _, job = upload(base_url, token, data, "isolation.csv")
    time.sleep(5)  # let the offline worker get going
    during = open_loop(url, headers, rate, seconds, seed=2)
    progress = requests.get(
        f"{base_url}/api/v1/jobs/{job['id']}", headers={"Authorization": f"Token {token}"}, timeout=30
    ).json()
    requests.post(f"{base_url}/api/v1/jobs/{job['id']}/cancel", headers={"Authorization": f"Token {token}"}, timeout=30)
    return {
        "rate_per_s": round(rate, 1),
        "seconds": seconds,
        "alone_p99_ms": alone.percentile_ms(99),
        "alone_p50_ms": alone.percentile_ms(50),
        "alone_qps": round(alone.qps(), 1),
        "during_job_p99_ms": during.percentile_ms(99),
        "during_job_p50_ms": during.percentile_ms(50),
        "during_job_qps": round(during.qps(), 1),
        "offline_rows_done_meanwhile": progress["done_rows"],
        "offline_rows_per_s": round(progress["rows_per_s"], 1),
    }


def targets(steps: list[Step], ceiling: Ceiling, scenarios: dict) -> list[tuple[str, str, bool | None]]:
    platform = [s for s in steps if s.system == "platform"]
    naive = [s for s in steps if s.system == "naive"]
    out: list[tuple[str, str, bool | None]] = []
    if not platform:
        return out
    top = max(platform, key=lambda s: s.qps)
    peak = top.qps
    # The platform runs N online children with one torch thread each: its ceiling is N such processes
    # running length-sorted passes at once (measured, not N times one process).
    children, ceiling_n = max(ceiling.parallel.items(), default=(1, ceiling.best(sorted_=True)[1]))
    if naive:
        naive_peak = max(s.qps for s in naive)
        out.append(
            (
                "peak QPS >= 1.5 x naive peak",
                f"{peak:.1f} / {naive_peak:.1f} = {peak / naive_peak:.2f}",
                peak / naive_peak >= 1.5,
            )
        )
    out.append(
        (
            f"peak QPS >= 0.8 x in-process ceiling ({children} processes)",
            f"{peak:.1f} / {ceiling_n:.1f} = {peak / ceiling_n:.2f}",
            peak / ceiling_n >= 0.8,
        )
    )
    gap = ceiling_gap(top.qps, top.model_cpu_pct or 0, ceiling_n, children)
    if gap:
        out.append(
            (
                "where the gap to the ceiling is (at the peak step)",
                f"{gap.ratio:.2f} = CPU share {gap.cpu_share:.2f} (the model's processes had "
                f"{top.model_cpu_pct:.0f}% of {children * 100}%) x efficiency {gap.efficiency:.2f} "
                "(their texts per CPU-second over the ceiling's)",
                None,
            )
        )
    last = max(platform, key=lambda s: s.concurrency)
    out.append(
        (
            f"no collapse: QPS at {last.concurrency} >= 0.9 x peak",
            f"{last.qps:.1f} / {peak:.1f} = {last.qps / peak:.2f}",
            last.qps / peak >= 0.9,
        )
    )
    worst = max(platform, key=lambda s: (s.p99_ms or 0) / (s.p50_ms or 1))
    ratio = (worst.p99_ms or 0) / (worst.p50_ms or 1)
    raw = ceiling.single_p99_ms / ceiling.single_p50_ms
    out.append(
        (
            "fairness: P99 <= 1.5 x P50 at every step",
            f"worst at {worst.concurrency}: {ratio:.2f} (the raw model alone, one request at a time: {raw:.2f})",
            ratio <= 1.5,
        )
    )
    c1 = next((s for s in platform if s.concurrency == 1), None)
    if c1 and c1.p50_ms:
        overhead = c1.p50_ms - ceiling.single_p50_ms
        out.append(
            (
                "overhead at c=1: P50 - raw single P50 <= 8 ms",
                f"{c1.p50_ms:.1f} - {ceiling.single_p50_ms:.1f} = {overhead:.1f} ms",
                overhead <= 8,
            )
        )
    if "overload" in scenarios:
        o = scenarios["overload"]
        out.append(
            (
                "overload: goodput >= 0.9 x peak",
                f"{o['goodput_qps']:.1f} / {peak:.1f} = {o['goodput_qps'] / peak:.2f}",
                o["goodput_qps"] / peak >= 0.9,
            )
        )
        out.append(("overload: no errors but 503", f"other statuses {o['other_statuses']}", not o["other_statuses"]))
    if "isolation" in scenarios:
        i = scenarios["isolation"]
        r = (i["during_job_p99_ms"] or 0) / (i["alone_p99_ms"] or 1)
        out.append(
            (
                "isolation: P99 during job <= 1.5 x alone",
                f"{fmt(i['during_job_p99_ms'])} / {fmt(i['alone_p99_ms'])} = {r:.2f}",
                r <= 1.5,
            )
        )
    return out


def verdict_table(rows: list[tuple[str, str, bool | None]]) -> list[str]:
    """Markdown lines of (target, figures, met) rows; None in `met` is an informational row ("–")."""
    lines = ["| target | figures | met |", "|---|---|---|"]
    return lines + [f"| {t} | {f} | {'–' if ok is None else 'met' if ok else 'missed'} |" for t, f, ok in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stack_arguments(parser)
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,40")
    parser.add_argument("--seconds", type=float, default=30.0, help="per step")
    parser.add_argument("--no-naive", action="store_true")
    parser.add_argument("--no-ceiling", action="store_true")
    parser.add_argument("--scenarios", default="overload,isolation", help="comma list, or empty")
    parser.add_argument("--scenario-seconds", type=float, default=60.0)
    args = parser.parse_args()

    stack = Target.of(args)
    out, token, headers, platform_url = stack.out, stack.token, stack.headers, stack.predict_url
    client, web, workers = stack.client, stack.web, stack.workers
    levels = [int(c) for c in args.concurrency.split(",")]

    ceiling = None
    if not args.no_ceiling:
        print("model ceiling (in-process, 1 thread) ...", flush=True)
        ceiling = measure(args.model, [CORPUS[i % len(CORPUS)] for i in range(576)], processes=args.children)
    steps: list[Step] = []
    for level in levels:
        print(f"platform  c={level:>3} for {args.seconds:.0f} s ...", flush=True)
        steps.append(run_step("platform", platform_url, headers, level, args.seconds, web, workers, client, level))
        print("   " + table([steps[-1]]).splitlines()[-1], flush=True)
    if not args.no_naive:
        naive, naive_url = start_naive(args.model)
        try:
            server = [psutil.Process(naive.pid)]
            for level in levels:
                print(f"naive     c={level:>3} for {args.seconds:.0f} s ...", flush=True)
                steps.append(run_step("naive", naive_url, {}, level, args.seconds, server, [], None, level))
                print("   " + table([steps[-1]]).splitlines()[-1], flush=True)
        finally:
            naive.terminate()
            naive.wait(timeout=30)

    scenarios: dict = {}
    wanted = [s for s in args.scenarios.split(",") if s]
    capacity = max((s.qps for s in steps if s.system == "platform"), default=0.0)
    everything = web + workers + with_children(processes(["celery", "-Q offline"]))
    if "overload" in wanted and capacity:
        print(f"overload: open loop at 3 x {capacity:.1f}/s for {args.scenario_seconds:.0f} s ...", flush=True)
        scenarios["overload"] = overload(platform_url, headers, capacity, args.scenario_seconds, everything)
    if "isolation" in wanted and capacity:
        print(f"isolation: {capacity / 2:.1f}/s alone, then beside a 20,000-row job ...", flush=True)
        scenarios["isolation"] = isolation(platform_url, headers, capacity, args.scenario_seconds, args.url, token)

    report = [
        f"# Sweep {time.strftime('%Y-%m-%d %H:%M')} ({args.seconds:.0f} s per step, model {args.model})",
        "",
        table(steps),
        "",
    ]
    if ceiling:
        report += [
            "Model ceiling in-process (1 process, 1 torch thread): single request P50 "
            f"{ceiling.single_p50_ms:.1f} ms, P99 {ceiling.single_p99_ms:.1f} ms (mean {ceiling.single_mean_ms:.1f} ms); "
            "texts/s by batch size, "
            "arrival order / length-sorted: "
            + ", ".join(f"{b}: {a:.1f} / {s:.1f}" for b, (a, s) in ceiling.per_batch_size.items())
            + "".join(
                f"; {n} processes at once, length-sorted at the best batch size: {rate:.1f} texts/s"
                for n, rate in ceiling.parallel.items()
            ),
            "",
        ]
    for name, figures in scenarios.items():
        report += [f"{name}: `{json.dumps(figures)}`", ""]
    if ceiling:
        report += verdict_table(targets(steps, ceiling, scenarios))
    text = "\n".join(report)
    print("\n" + text)
    (out / "sweep.md").write_text(text + "\n")
    with open(out / "sweep.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(steps[0])))
        writer.writeheader()
        writer.writerows(asdict(s) for s in steps)
    (out / "scenarios.json").write_text(json.dumps(scenarios, indent=2))
    chart(steps, out / "sweep.png")
    print(f"\nwrote {out / 'sweep.md'}, sweep.csv, sweep.png")


if __name__ == "__main__":
    main()
