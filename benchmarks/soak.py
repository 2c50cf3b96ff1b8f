"""Soak: does memory stay flat? Varied online load at about 70% of peak plus offline jobs, for 30 minutes,
with the RSS of every platform process sampled each minute (issue 23, item 5; the article's "memory
grows slowly" row).

    make run    # in another terminal
    .venv/bin/python -m benchmarks.soak [--minutes 30] [--peak-rps N] [--job-rows 1500 --job-every-s 180]

The peak is measured first (16 closed-loop clients for 20 s) unless --peak-rps gives it. Then the online
load is an open loop whose rate changes every 2 minutes between 50% and 90% of the peak (70% on
average), one text per request from benchmarks/corpus.txt; a CSV job of --job-rows rows is uploaded every
--job-every-s seconds. Every --sample-s seconds each platform process is found by its command line (the
web processes, each Celery worker's main process and its pool children, Flower) and its RSS and PSS
are read (PSS shares a page among the processes that map it: preloaded models are counted once).
Children replaced meanwhile are summed under their role, so a role's figure is the memory that role
holds. Growth is measured from the sample at --settle-min minutes to the last: target at most 5%.

Writes benchmarks/out/soak.json, soak.md and soak.png.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import requests

from benchmarks.loadgen import CORPUS, HERE, closed_loop, open_loop
from benchmarks.smoke import default_token
from benchmarks.upload import upload

OUT = HERE / "out"
GROWTH_TARGET_PCT = 5.0


def role_of(proc: psutil.Process) -> str | None:
    """Which part of the platform a process is, from its and its ancestors' command lines (None: not the
    platform's). A web process's workers and a Celery worker's pool children are counted under their
    parent's role; the Procfile's shell wrappers are not processes of the platform."""
    try:
        chain = [" ".join(p.cmdline()) for p in [proc, *proc.parents()] if p.name() not in ("sh", "bash", "env")]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    cmd = chain[0]
    if any("platform_.server" in c for c in chain[:2]):
        return "web"
    if "celery" in cmd and "flower" in cmd:
        return "flower"
    if "celery" in cmd and " worker" in cmd:
        queue = "online" if "-Q online" in cmd else "offline" if "-Q offline" in cmd else "worker"
        # A pool child has its parent's command line (fork without exec).
        forked = len(chain) > 1 and chain[1] == cmd
        return f"{queue} children" if forked else f"{queue} main"
    return None


def stack_root() -> psutil.Process:
    """The process `make run` started (scripts/run.py): the soak measures its descendants only, not another
    stack on the same machine (a test run's, say)."""
    for proc in psutil.process_iter(["cmdline"]):
        if any(part.endswith("scripts/run.py") for part in proc.info["cmdline"] or []):
            return proc
    raise SystemExit("no `make run` stack (scripts/run.py) is running")


def sample(root: psutil.Process) -> dict[str, dict[str, float]]:
    """role -> {rss_mb, pss_mb, processes} for every platform process of the stack now."""
    found: dict[str, dict[str, float]] = {}
    for proc in root.children(recursive=True):
        role = role_of(proc)
        if role is None:
            continue
        try:
            info = proc.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        row = found.setdefault(role, {"rss_mb": 0.0, "pss_mb": 0.0, "processes": 0})
        row["rss_mb"] += info.rss / 2**20
        row["pss_mb"] += getattr(info, "pss", info.rss) / 2**20
        row["processes"] += 1
    return found


@dataclass
class Soak:
    minutes: float
    peak_rps: float
    samples: list[dict] = field(default_factory=list)  # {"t_min", "roles": {role: {...}}}
    load: list[dict] = field(default_factory=list)  # per 2-minute block: rate, qps, p50/p99, errors
    jobs: list[dict] = field(default_factory=list)

    def growth_pct(self, settle_min: float, measure: str = "rss_mb") -> dict[str, float]:
        start = next((s for s in self.samples if s["t_min"] >= settle_min), None)
        last = self.samples[-1] if self.samples else None
        if start is None or last is None or last is start:
            return {}
        growth = {}
        for role, row in last["roles"].items():
            before = start["roles"].get(role, {}).get(measure)
            if before:
                growth[role] = (row[measure] - before) / before * 100
        total_before = sum(r[measure] for r in start["roles"].values())
        growth["all"] = (sum(r[measure] for r in last["roles"].values()) - total_before) / total_before * 100
        return growth


def _csv(rows: int, seed: int) -> bytes:
    rng = random.Random(seed)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["id", "text"])
    for i in range(rows):
        writer.writerow([f"s{seed}-{i}", rng.choice(CORPUS)])
    return out.getvalue().encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("PLATFORM_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--model", default="router")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument("--settle-min", type=float, default=5.0, help="growth is measured from this sample on")
    parser.add_argument("--peak-rps", type=float, default=0.0, help="skip measuring the peak")
    parser.add_argument("--job-rows", type=int, default=1500)
    parser.add_argument("--job-every-s", type=float, default=180.0)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    token = default_token()
    headers = {"Authorization": f"Token {token}"}
    url = f"{args.url}/api/v1/models/{args.model}/predict"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    peak = args.peak_rps
    if not peak:
        peak = closed_loop(url, headers, 16, 20.0, seed=5).qps()
        print(f"peak: {peak:.1f} req/s (16 closed-loop clients, 20 s)", flush=True)
    soak = Soak(args.minutes, round(peak, 1))
    root = stack_root()
    started = time.monotonic()
    stop_at = started + args.minutes * 60
    stopping = threading.Event()

    def sampler() -> None:
        while True:
            soak.samples.append({"t_min": round((time.monotonic() - started) / 60, 2), "roles": sample(root)})
            total = sum(r["rss_mb"] for r in soak.samples[-1]["roles"].values())
            print(f"{soak.samples[-1]['t_min']:5.1f} min: platform RSS {total:.0f} MB", flush=True)
            if stopping.wait(args.sample_s):
                return

    def jobs() -> None:
        seed = 0
        while not stopping.is_set():
            seed += 1
            try:
                _, job = upload(args.url, token, _csv(args.job_rows, seed), filename=f"soak-{seed}.csv")
                soak.jobs.append({"t_min": round((time.monotonic() - started) / 60, 2), "id": job["id"]})
            except requests.RequestException as exc:
                soak.jobs.append({"t_min": round((time.monotonic() - started) / 60, 2), "error": str(exc)[:200]})
            if stopping.wait(args.job_every_s):
                return

    threads = [threading.Thread(target=sampler, daemon=True), threading.Thread(target=jobs, daemon=True)]
    for thread in threads:
        thread.start()
    block = 0
    while time.monotonic() < stop_at - 1:
        share = 0.5 if block % 2 == 0 else 0.9
        seconds = min(120.0, stop_at - time.monotonic())
        run = open_loop(url, headers, share * peak, seconds, seed=100 + block)
        soak.load.append(
            {
                "block": block,
                "rate_per_s": round(share * peak, 1),
                "qps": round(run.qps(), 1),
                "p50_ms": run.percentile_ms(50),
                "p99_ms": run.percentile_ms(99),
                "not_200": len(run.results) - len(run.ok()),
            }
        )
        print(f"block {block}: {json.dumps(soak.load[-1])}", flush=True)
        block += 1
    stopping.set()
    for thread in threads:
        thread.join(timeout=30)
    soak.samples.append({"t_min": round((time.monotonic() - started) / 60, 2), "roles": sample(root)})
    for job in soak.jobs:
        if "id" in job:
            answer = requests.get(f"{args.url}/api/v1/jobs/{job['id']}", headers=headers, timeout=30)
            if answer.ok:
                job.update({k: answer.json().get(k) for k in ("status", "done_rows", "total_rows")})
    write(soak, out, args.settle_min)


def write(soak: Soak, out: Path, settle_min: float) -> None:
    growth, growth_pss = soak.growth_pct(settle_min), soak.growth_pct(settle_min, "pss_mb")
    (out / "soak.json").write_text(
        json.dumps({**asdict(soak), "growth_pct": growth, "growth_pss_pct": growth_pss}, indent=2)
    )
    roles = sorted({role for s in soak.samples for role in s["roles"]})
    lines = [
        f"Soak: {soak.minutes:.0f} min, online open loop alternating 50% / 90% of a {soak.peak_rps} req/s peak "
        f"every 2 min, {len(soak.jobs)} offline jobs; RSS (PSS) in MB per role, sampled each minute.",
        "",
        "| min | " + " | ".join(roles) + " | all |",
        "|---" * (len(roles) + 2) + "|",
    ]
    for s in soak.samples:
        cells = [
            f"{s['roles'][r]['rss_mb']:.0f} ({s['roles'][r]['pss_mb']:.0f})" if r in s["roles"] else "–" for r in roles
        ]
        total = sum(row["rss_mb"] for row in s["roles"].values())
        lines.append(f"| {s['t_min']:.1f} | " + " | ".join(cells) + f" | {total:.0f} |")
    lines += ["", f"Growth from minute {settle_min:g} to the end (target at most {GROWTH_TARGET_PCT:g}%):", ""]
    for role, pct in growth.items():
        verdict = "met" if pct <= GROWTH_TARGET_PCT else "MISSED"
        lines.append(f"- {role}: RSS {pct:+.1f}% (PSS {growth_pss.get(role, 0.0):+.1f}%): {verdict}")
    lines += ["", "| block | rate req/s | answered req/s | P50 ms | P99 ms | not 200 |", "|---|---|---|---|---|---|"]
    for b in soak.load:
        lines.append(
            f"| {b['block']} | {b['rate_per_s']} | {b['qps']} | {b['p50_ms'] or 0:.0f} | {b['p99_ms'] or 0:.0f} | "
            f"{b['not_200']} |"
        )
    lines += ["", "Jobs: " + ", ".join(f"{j.get('status', j.get('error', '?'))}" for j in soak.jobs)]
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    times = [s["t_min"] for s in soak.samples]
    for role in roles:
        ax.plot(times, [s["roles"].get(role, {}).get("rss_mb") for s in soak.samples], marker="o", ms=3, label=role)
    ax.plot(times, [sum(r["rss_mb"] for r in s["roles"].values()) for s in soak.samples], "k--", label="all")
    ax.axvline(settle_min, color="grey", lw=0.8)
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS, MB")
    ax.set_title(f"Soak: RSS per role (growth after minute {settle_min:g}: all {growth.get('all', 0):+.1f}%)")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)


if __name__ == "__main__":
    main()
