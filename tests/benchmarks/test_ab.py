"""benchmarks.ab: verdicts on ratios taken within a round, and a short run against the live stack."""

from __future__ import annotations

import json

import pytest

from benchmarks.ab import Round, summary
from benchmarks.sweep import Step
from tests.benchmarks.driver import run_benchmark


def _step(system: str, concurrency: int, qps: float, model_cpu_pct: float | None = None) -> Step:
    return Step(
        system, concurrency, int(qps * 10), qps, 10.0, 20.0, 30.0, 12.0, 0, 0, 0, 10, 0, 1, None, None,
        model_cpu_pct=model_cpu_pct,
    )  # fmt: skip


def _round(index: int, ceiling: float, low: dict[int, tuple[float, float]], peak: float, cpu: float) -> Round:
    rnd = Round(index, ceiling, ceiling * 0.9)
    rnd.low = {level: (_step("platform", level, p), _step("naive", level, n)) for level, (p, n) in low.items()}
    rnd.peak = _step("platform", 40, peak, cpu)
    return rnd


def test_each_verdict_is_the_median_of_ratios_taken_within_a_round():
    # The machine slowed down in round 2: every figure halved. The naive server's best figure (round 1)
    # against the platform's worst (round 2) would read 0.6; within each round the platform is ahead.
    rounds = [
        _round(1, 200.0, {1: (66.0, 60.0)}, 160.0, 170),
        _round(2, 100.0, {1: (36.0, 30.0)}, 80.0, 170),
        _round(3, 180.0, {1: (57.0, 60.0)}, 171.0, 180),
    ]
    rows = {target.split(":")[0]: (figures, met) for target, figures, met in summary(rounds, children=2)}
    assert rows["c=1"] == ("per round 1.10, 1.20, 0.95; median 1.10", True)
    peak_figures, peak_met = rows["c=40"]
    assert peak_figures == "per round 0.80, 0.80, 0.95; median 0.80" and peak_met is False
    split = next(f for t, f, _ in summary(rounds, children=2) if t.startswith("of which"))
    # 170% of 200%: share 0.85, and 0.80 / 0.85 = 0.94 of the ceiling's texts per CPU-second.
    assert "share 0.85, 0.85, 0.90 (median 0.85)" in split
    assert "efficiency 0.94, 0.94, 1.06 (median 0.94)" in split


def test_a_low_level_that_misses_in_the_median_is_reported_missed():
    rounds = [_round(n, 180.0, {2: (p, 100.0)}, 150.0, 170) for n, p in enumerate([99.0, 101.0, 97.0], 1)]
    (target, figures, met), *_ = summary(rounds, children=2)
    assert target.startswith("c=2") and "median 0.99" in figures and met is False


@pytest.mark.integration
def test_rounds_run_both_systems_and_the_ceiling_and_write_the_report(stack, redis_url, tmp_path):
    args = "--rounds 2 --seconds 2 --low 1 --peak 4 --ceiling-texts 48".split()
    result = run_benchmark("benchmarks.ab", stack, redis_url, tmp_path, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    rounds = json.loads((tmp_path / "ab.json").read_text())
    assert [r["index"] for r in rounds] == [1, 2]
    for r in rounds:
        assert r["ceiling_qps"] > 0 and r["reachable_qps"] > 0
        platform, naive = r["low"]["1"]
        assert (platform["system"], naive["system"]) == ("platform", "naive")
        assert platform["requests"] > 0 and naive["requests"] > 0 and r["peak"]["requests"] > 0
        assert platform["errors"] == naive["errors"] == r["peak"]["errors"] == 0
    report = (tmp_path / "ab.md").read_text()
    assert "| c=1: platform QPS >= 1 x naive, same round |" in report
    assert "| c=4: platform QPS >= 0.88 x 2-process ceiling, same round |" in report
