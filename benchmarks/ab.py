"""Low load against the naive server and the peak against the ceiling, measured in alternating rounds.

    python -m benchmarks.ab [--rounds 3] [--seconds 10] [--low 1,2] [--peak 40]

Needs a running stack (`make run`); starts the naive server itself and keeps it up, idle between its steps.
Why not the sweep: the sweep measures the ceiling once, then every platform step, then every naive step,
minutes apart. On a shared 2-core VM the same command's figures moved by a factor of two between runs
minutes apart (the naive server's one-client QPS from 24.7 to 60.5; the ceiling from 106 to 181 texts/s),
so a ratio of two figures taken minutes apart measured the machine as much as the systems. Here each
round measures, back to back,
  1. the N-process length-sorted ceiling (fresh processes, one torch thread each), at its usual dispatch
     of four batches' worth, and at the dispatch `peak` closed-loop clients can give each of N children
     (no more than peak / N requests can be waiting when a child frees);
  2. the platform and the naive server at each low level (which goes first alternates by round);
  3. the platform at the peak level,
and the ratios are taken within a round; the verdicts are on their medians over rounds, each round shown.
Writes ab.md and ab.json under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import psutil

from benchmarks.ceiling import parallel_sorted_rate
from benchmarks.loadgen import CORPUS
from benchmarks.sweep import Step, Target, ceiling_gap, fmt, run_step, stack_arguments, start_naive, verdict_table

# Issue 23's targets: at low load at least the naive server's QPS; the peak at least this share of the ceiling.
LOW_TARGET = 1.0
PEAK_TARGET = 0.88


@dataclass
class Round:
    index: int
    ceiling_qps: float  # N processes, length-sorted, four batches' worth per dispatch
    reachable_qps: float | None  # the same at the dispatch the peak's clients allow each child
    low: dict[int, tuple[Step, Step]] = field(default_factory=dict)  # level -> (platform, naive)
    peak: Step | None = None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratios(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def summary(rounds: list[Round], children: int) -> list[tuple[str, str, bool | None]]:
    """The verdicts: each a median over rounds of a ratio taken within a round (rounds listed in order)."""
    out: list[tuple[str, str, bool | None]] = []
    levels = sorted({level for r in rounds for level in r.low})
    for level in levels:
        ratios = [p.qps / n.qps for r in rounds if level in r.low for p, n in [r.low[level]] if n.qps]
        mid = _median(ratios)
        out.append(
            (
                f"c={level}: platform QPS >= {LOW_TARGET:g} x naive, same round",
                f"per round {_ratios(ratios)}; median {fmt(mid, 2)}",
                None if mid is None else mid >= LOW_TARGET,
            )
        )
    peaks = [r for r in rounds if r.peak is not None and r.ceiling_qps > 0]
    if not peaks:
        return out
    level = peaks[0].peak.concurrency
    ratios = [r.peak.qps / r.ceiling_qps for r in peaks]
    mid = _median(ratios)
    out.append(
        (
            f"c={level}: platform QPS >= {PEAK_TARGET:g} x {children}-process ceiling, same round",
            f"per round {_ratios(ratios)}; median {mid:.2f}",
            mid >= PEAK_TARGET,
        )
    )
    gaps = [g for r in peaks if (g := ceiling_gap(r.peak.qps, r.peak.model_cpu_pct or 0, r.ceiling_qps, children))]
    if gaps:
        out.append(
            (
                "of which CPU share x efficiency (medians)",
                f"share {_ratios([g.cpu_share for g in gaps])} (median {_median([g.cpu_share for g in gaps]):.2f}); "
                f"efficiency {_ratios([g.efficiency for g in gaps])} (median {_median([g.efficiency for g in gaps]):.2f})",
                None,
            )
        )
    reachable = [r.peak.qps / r.reachable_qps for r in peaks if r.reachable_qps]
    if reachable:
        dispatch = max(1, level // children)
        out.append(
            (
                f"c={level} against the ceiling at the dispatch its clients allow ({dispatch} texts)",
                f"per round {_ratios(reachable)}; median {_median(reachable):.2f}",
                None,
            )
        )
    return out


def report(rounds: list[Round], children: int, seconds: float, model: str) -> str:
    levels = sorted({level for r in rounds for level in r.low})
    peak_level = next((r.peak.concurrency for r in rounds if r.peak), None)
    head = ["round", f"ceiling texts/s ({children} proc.)", "at the peak's dispatch"]
    head += [f"c={level} platform / naive QPS" for level in levels]
    if peak_level:
        head += [f"c={peak_level} QPS", "model CPU %", "peak / ceiling"]
    lines = [
        f"# Alternating rounds {time.strftime('%Y-%m-%d %H:%M')} "
        f"({len(rounds)} rounds, {seconds:.0f} s per step, model {model}, {children} children)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rounds:
        cells = [str(r.index), f"{r.ceiling_qps:.1f}", fmt(r.reachable_qps, 1)]
        for level in levels:
            p, n = r.low.get(level, (None, None))
            cells.append("–" if p is None else f"{p.qps:.1f} / {n.qps:.1f} = {p.qps / n.qps:.2f}" if n.qps else "–")
        if peak_level:
            cells += [
                fmt(r.peak and r.peak.qps, 1),
                fmt(r.peak and r.peak.model_cpu_pct),
                fmt(r.peak.qps / r.ceiling_qps if r.peak and r.ceiling_qps else None, 2),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    errors = sum(s.errors + s.timeouts_504 for r in rounds for s in _steps(r))
    refused = sum(s.refused_503 for r in rounds for s in _steps(r))
    lines += ["", f"Errors and 504 over all steps: {errors}; 503: {refused}.", ""]
    lines += verdict_table(summary(rounds, children))
    return "\n".join(lines)


def _steps(r: Round) -> list[Step]:
    return [s for pair in r.low.values() for s in pair] + ([r.peak] if r.peak else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stack_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="per step")
    parser.add_argument("--low", default="1,2", help="low concurrency levels, platform against naive")
    parser.add_argument("--peak", type=int, default=40, help="the platform's peak level, against the ceiling")
    parser.add_argument("--batch-size", type=int, default=32, help="the ceiling's pass size (the sweep's best)")
    parser.add_argument("--ceiling-texts", type=int, default=576)
    args = parser.parse_args()

    stack = Target.of(args)
    levels = [int(c) for c in args.low.split(",") if c]
    texts = [CORPUS[i % len(CORPUS)] for i in range(args.ceiling_texts)]
    reachable_dispatch = max(1, args.peak // args.children)

    naive, naive_url = start_naive(args.model)
    # What run_step needs per system after its name and load: url, headers, server and worker processes, Redis.
    systems = {
        "platform": (stack.predict_url, stack.headers, stack.web, stack.workers, stack.client),
        "naive": (naive_url, {}, [psutil.Process(naive.pid)], [], None),
    }
    rounds: list[Round] = []
    try:
        for index in range(1, args.rounds + 1):
            print(f"round {index}: ceiling ({args.children} processes) ...", flush=True)
            rnd = Round(
                index,
                parallel_sorted_rate(args.model, texts, args.children, args.batch_size),
                parallel_sorted_rate(args.model, texts, args.children, args.batch_size, dispatch=reachable_dispatch),
            )
            order = ("platform", "naive") if index % 2 else ("naive", "platform")
            for level in levels:
                got = {}
                for system in order:
                    print(f"round {index}: {system} c={level} ...", flush=True)
                    url, headers, server, workers, client = systems[system]
                    got[system] = run_step(system, url, headers, level, args.seconds, server, workers, client, index)
                rnd.low[level] = (got["platform"], got["naive"])
            print(f"round {index}: platform c={args.peak} ...", flush=True)
            url, headers, server, workers, client = systems["platform"]
            rnd.peak = run_step("platform", url, headers, args.peak, args.seconds, server, workers, client, index)
            rounds.append(rnd)
    finally:
        naive.terminate()
        naive.wait(timeout=30)

    text = report(rounds, args.children, args.seconds, args.model)
    print("\n" + text)
    (stack.out / "ab.md").write_text(text + "\n")
    (stack.out / "ab.json").write_text(json.dumps([asdict(r) for r in rounds], indent=2, default=str))
    print(f"\nwrote {stack.out / 'ab.md'}, ab.json")


if __name__ == "__main__":
    main()
