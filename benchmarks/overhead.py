"""The platform's own cost per request, measured as Triton's identity model is used with perf_analyzer.

    python -m benchmarks.overhead [--url http://127.0.0.1:8000] [--seconds 15] [--concurrency 1,32]
                                  [--sweep 1,2,4,8,16,32,64] [--model identity] [--profile]

Needs a running stack (`make run`). The platform serves `--model` (default `identity`: no weights, so a
request costs the platform's path and nearly no model); the baseline, started here, is
benchmarks/naive_server.py serving a tiny random BERT (benchmarks/tiny_bert.py). Load: wrk (one thread,
N keep-alive connections, closed loop) with benchmarks/wrk_post.lua: one text per request, drawn from
benchmarks/corpus.txt; the script counts responses by status and prints one JSON summary line.

CPU: user + system seconds of each process group, read from /proc (psutil) just before and after each
step, divided by the 2xx answers of the step: `web` (uvicorn and its workers), `worker-main` (the online
Celery worker's main process), `children` (its prefork children), `redis` (the redis-server on REDIS_URL's
port; it may serve others too), `naive` (the baseline server), `loadgen` (wrk itself, from its rusage).
`machine` is all busy CPU time in /proc/stat per request, `idle` the machine's idle share during the step:
near 0 means the cores were saturated. Only the stack serving --url's port is counted (its uvicorn, and
the online worker the same honcho started), so another stack on the same machine is left out.

Steps alternate systems (naive c=1, platform c=1, naive c=32, ...) so noise hits both alike: the headline
levels (--concurrency) first, then the sweep levels not already run. Writes benchmarks/out/overhead.md
and overhead.json; prints the targets met or missed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock
from urllib.parse import urlsplit

import psutil
import yaml

from benchmarks.loadgen import CORPUS, HERE
from benchmarks.smoke import default_token
from benchmarks.sweep import cpu_seconds, fmt, processes, start_naive, with_children
from benchmarks.tiny_bert import build_tiny_classifier

OUT = HERE / "out"
LUA = HERE / "wrk_post.lua"
MARK = "OVERHEAD_JSON "
Groups = dict[str, list[psutil.Process]]


@dataclass
class Wrk:
    """What wrk_post.lua's summary line says about one run."""

    requests: int
    duration_us: int
    statuses: dict[str, int]
    errors: dict[str, int]
    latency_us: dict[str, float]

    @property
    def ok(self) -> int:
        return sum(n for status, n in self.statuses.items() if status.startswith("2"))

    @property
    def non_2xx(self) -> int:
        return sum(self.statuses.values()) - self.ok

    @property
    def socket_errors(self) -> int:
        return sum(self.errors.values())


def parse_wrk(output: str) -> Wrk:
    for line in output.splitlines():
        if line.startswith(MARK):
            return Wrk(**json.loads(line[len(MARK) :]))
    raise ValueError(f"no {MARK.strip()} line in wrk's output:\n{output[-2000:]}")


def per_request_us(cpu_s: Mapping[str, float], requests: int) -> dict[str, float | None]:
    """CPU seconds per group -> µs per request (None when nothing was answered), plus their `total`."""
    out: dict[str, float | None] = {k: (round(v * 1e6 / requests) if requests else None) for k, v in cpu_s.items()}
    out["total"] = round(sum(cpu_s.values()) * 1e6 / requests) if requests else None
    return out


def busy_idle(before: Mapping[str, float], after: Mapping[str, float]) -> tuple[float, float]:
    """(busy CPU seconds over all cores, idle share 0..1) between two /proc/stat readings (psutil field names)."""
    delta = {k: after[k] - before[k] for k in before if k not in ("guest", "guest_nice")}  # already in user/nice
    total = sum(delta.values()) or 1e-9
    idle = delta.get("idle", 0.0) + delta.get("iowait", 0.0)
    return total - idle, idle / total


@dataclass
class Step:
    system: str
    concurrency: int
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    ok: int
    non_2xx: int
    socket_errors: int
    statuses: dict[str, int]
    idle_pct: float
    loadgen_core_pct: float
    cpu_us_per_req: dict[str, float | None] = field(default_factory=dict)


def run_wrk(url: str, concurrency: int, seconds: float, env: dict[str, str]) -> tuple[Wrk, float]:
    """One wrk run; returns its summary and wrk's own CPU seconds (its rusage, read when it is reaped)."""
    cmd = ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds:g}s", "--timeout", "10s", "--latency", "-s", str(LUA), url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **env}, text=True)
    assert proc.stdout is not None
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"wrk failed ({proc.returncode}): {output[-2000:]}")
    return parse_wrk(output), usage.ru_utime + usage.ru_stime


def step(system: str, url: str, concurrency: int, seconds: float, env: dict[str, str], groups: Groups) -> Step:
    before = {name: cpu_seconds(procs) for name, procs in groups.items()}
    stat_before = psutil.cpu_times()._asdict()
    result, loadgen_s = run_wrk(url, concurrency, seconds, env)
    busy_s, idle = busy_idle(stat_before, psutil.cpu_times()._asdict())
    cpu = {name: max(0.0, cpu_seconds(procs) - before[name]) for name, procs in groups.items()}
    cpu["loadgen"] = loadgen_s
    per_req = per_request_us(cpu, result.ok)
    per_req["machine"] = round(busy_s * 1e6 / result.ok) if result.ok else None
    wall_s = result.duration_us / 1e6
    return Step(
        system,
        concurrency,
        round(result.ok / wall_s, 1),
        *(result.latency_us[f"p{q}"] / 1000 for q in (50, 90, 99)),
        result.ok,
        result.non_2xx,
        result.socket_errors,
        result.statuses,
        round(idle * 100, 1),
        round(loadgen_s / wall_s * 100, 1),
        per_req,
    )


def platform_groups(port: int) -> Groups:
    """The stack's process groups, found as benchmarks/profile.sh does; when the uvicorn on `port` runs under
    honcho (`make run`), only the online worker started by the same honcho counts (not another stack's)."""
    masters = [p for p in processes(["-m platform_.server"]) if f"--port {port} " in " ".join(p.cmdline()) + " "]
    if not masters:
        raise SystemExit(f"no platform_.server on port {port}: start the stack (`make run`)")
    honcho = [p for p in masters[0].parents() if "honcho" in " ".join(p.cmdline())]
    online = processes(["bin/celery", "worker", "-Q online"])
    if honcho:
        ours = {p.pid for p in honcho[-1].children(recursive=True)}
        online = [p for p in online if p.pid in ours]
    pids = {p.pid for p in online}
    mains = [p for p in online if p.ppid() not in pids]
    redis_url = masters[0].environ().get("REDIS_URL", os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    port_ = str(urlsplit(redis_url).port or 6379)
    servers = [p for p in psutil.process_iter(["name", "cmdline"]) if (p.info["name"] or "").startswith("redis-server")]
    # Its title is `redis-server 127.0.0.1:6379`, or the command line when started with --port.
    redis = [p for p in servers if any(a.rpartition(":")[2] == port_ for a in " ".join(p.info["cmdline"]).split())]
    return {
        "web": with_children(masters),
        "worker-main": mains,
        "children": [c for m in mains for c in m.children(recursive=True)],
        "redis": redis,
    }


def table(steps: list[Step]) -> str:
    cols = ["web", "worker-main", "children", "redis", "naive", "loadgen", "total", "machine"]
    head = "| system | c | req/s | P50 ms | P90 ms | P99 ms | non-2xx | sock err | " + " | ".join(cols) + " | idle % |"
    lines = [head, "|" + "---|" * (9 + len(cols))]
    for s in steps:
        cpu = " | ".join(fmt(s.cpu_us_per_req.get(c)) for c in cols)
        lines.append(
            f"| {s.system} | {s.concurrency} | {s.rps:.1f} | {s.p50_ms:.2f} | {s.p90_ms:.2f} | {s.p99_ms:.2f} | "
            f"{s.non_2xx} | {s.socket_errors} | {cpu} | {s.idle_pct:.0f} |"
        )
    return "\n".join(lines)


def targets(steps: list[Step]) -> list[tuple[str, str, bool | None]]:
    platform = [s for s in steps if s.system == "platform"]
    naive = [s for s in steps if s.system == "naive"]
    out: list[tuple[str, str, bool | None]] = []
    if platform and naive:
        peak, best = max(s.rps for s in platform), max(s.rps for s in naive)
        bad = sum(s.non_2xx + s.socket_errors for s in platform)
        figures = f"{peak:.1f} / {best:.1f} = {peak / max(best, 1e-9):.2f}; platform non-2xx + socket errors {bad}"
        out.append(("platform peak req/s >= 3 x naive best, zero non-2xx", figures, peak >= 3 * best and bad == 0))
    p1 = next((s for s in platform if s.concurrency == 1), None)
    n1 = next((s for s in naive if s.concurrency == 1), None)
    if p1 and n1:
        gap = p1.p50_ms - n1.p50_ms
        figures = f"{p1.p50_ms:.2f} - {n1.p50_ms:.2f} = {gap:.2f} ms"
        out.append(("platform P50 at 1 client <= naive P50 at 1 client + 2 ms", figures, gap <= 2))
    return out


def profile(url: str, seconds: float, env: dict[str, str], port: int, out: Path) -> Step | None:
    """One extra platform step at 32 clients with py-spy (raw stacks) on a web worker, the worker main, a child."""
    spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if not spy:
        print("py-spy not found: --profile skipped (pip install -r requirements-dev.txt)")
        return None
    groups = platform_groups(port)
    web = [p for p in groups["web"] if "spawn_main" in " ".join(p.cmdline())] or groups["web"]  # a uvicorn worker
    targets_ = {"web": web[:1], "online-main": groups["worker-main"][:1], "online-child": groups["children"][:1]}
    record_s = max(1, int(seconds) - 2)
    spies = [
        subprocess.Popen(
            [spy, "record", "-p", str(procs[0].pid), "-d", str(record_s), "--nonblocking", "-r", "50", "-f", "raw"]
            + ["-o", str(out / f"overhead-profile-{name}.txt")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, procs in targets_.items()
        if procs
    ]
    result = step("platform (py-spy)", url, 32, seconds, env, groups)
    for proc in spies:
        proc.wait(timeout=60)
    for name in targets_:
        raw = out / f"overhead-profile-{name}.txt"
        if raw.exists():
            top = subprocess.run(
                [sys.executable, "-m", "benchmarks.flame", str(raw), "--top", "80"], capture_output=True, text=True
            ).stdout
            (out / f"overhead-profile-{name}-top.txt").write_text(top)
            lines = top.splitlines()
            below_trunk = [line for line in lines[1:] if float(line.split("%")[0]) < 90][:15]  # skip main()'s chain
            print(f"\n{name} ({raw}, {lines[0] if lines else 'nothing'}):\n" + "\n".join(below_trunk))
    return result


def start_tiny_naive(tmp: Path) -> tuple[subprocess.Popen, str]:
    """The naive baseline serving the tiny BERT as text-classification model `tiny` (a models file in `tmp`)."""
    tiny = {"task": "text-classification", "path": str(build_tiny_classifier(tmp / "tiny-bert"))}
    (tmp / "models.yaml").write_text(yaml.safe_dump({"default": "tiny", "models": {"tiny": tiny}}))
    with mock.patch.dict(os.environ, {"INFERENCE_MODELS_FILE": str(tmp / "models.yaml")}):  # the child inherits it
        return start_naive("tiny")


def report(steps: list[Step], extra: Step | None, args: argparse.Namespace) -> None:
    checks = targets(steps)
    text = "\n".join(
        [
            f"# Overhead {time.strftime('%Y-%m-%d %H:%M')} ({args.seconds:g} s per step; platform model "
            f"`{args.model}`, naive: tiny BERT)",
            "",
            table(steps + ([extra] if extra else [])),
            "",
            "CPU columns: µs of CPU (user + system) per 2xx answer; `machine`: all busy CPU in /proc/stat per "
            f"answer; `idle %`: the machine's idle share over the step ({psutil.cpu_count()} cores).",
            "",
            "| target | figures | met |",
            "|---|---|---|",
            *[f"| {t} | {f} | {'met' if ok else 'missed'} |" for t, f, ok in checks],
        ]
    )
    print("\n" + text)
    out = Path(args.out)
    (out / "overhead.md").write_text(text + "\n")
    payload = {
        "args": vars(args),
        "cores": psutil.cpu_count(),
        "steps": [asdict(s) for s in steps],
        "profiled_step": asdict(extra) if extra else None,
        "targets": [{"target": t, "figures": f, "met": ok} for t, f, ok in checks],
    }
    (out / "overhead.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {out / 'overhead.md'} and overhead.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("PLATFORM_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--model", default="identity")
    parser.add_argument("--seconds", type=float, default=15.0, help="per step")
    parser.add_argument("--concurrency", default="1,32", help="headline levels, run first")
    parser.add_argument("--sweep", default="1,2,4,8,16,32,64", help="then these levels (those not already run)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds per system before the steps")
    parser.add_argument("--profile", action="store_true", help="one more platform step at 32 clients under py-spy")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()

    Path(args.out).mkdir(parents=True, exist_ok=True)
    headline = [int(c) for c in args.concurrency.split(",") if c]
    levels = headline + [c for c in dict.fromkeys(int(c) for c in args.sweep.split(",") if c) if c not in headline]
    port = urlsplit(args.url).port or 80
    platform_groups(port)  # fail early when no stack answers on --url's port
    token = default_token()
    steps: list[Step] = []
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "bodies.jsonl").write_text("".join(json.dumps({"inputs": [text]}) + "\n" for text in CORPUS))
        naive, naive_url = start_tiny_naive(tmp)
        env = {"WRK_BODIES": str(tmp / "bodies.jsonl"), "WRK_TOKEN": token}
        systems: list[tuple[str, str, dict[str, str], Callable[[], Groups]]] = [
            (
                "naive",
                naive_url,
                {**env, "WRK_TOKEN": ""},
                lambda: {"naive": with_children([psutil.Process(naive.pid)])},
            ),
            ("platform", f"{args.url}/api/v1/models/{args.model}/predict", env, lambda: platform_groups(port)),
        ]
        try:
            for _, url, wrk_env, _ in systems:
                run_wrk(url, 4, args.warmup, wrk_env)
            for level in levels:
                for name, url, wrk_env, groups in systems:
                    print(f"{name:<9} c={level:>3} for {args.seconds:g} s ...", flush=True)
                    steps.append(step(name, url, level, args.seconds, wrk_env, groups()))
                    print("   " + table(steps[-1:]).splitlines()[-1], flush=True)
            extra = profile(systems[1][1], args.seconds, env, port, Path(args.out)) if args.profile else None
        finally:
            naive.terminate()
            naive.wait(timeout=30)
    report(steps, extra, args)


if __name__ == "__main__":
    main()
