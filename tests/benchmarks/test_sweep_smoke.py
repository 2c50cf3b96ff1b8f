"""A short smoke of the benchmark sweep against the live stack, so the command keeps working.

Benchmarks are not tests: no figure is asserted here, only that both systems were driven and the
report, table and chart were written.
"""

from __future__ import annotations

import csv

import pytest

from tests.benchmarks.driver import run_benchmark

pytestmark = pytest.mark.integration


def test_sweep_runs_both_systems_and_writes_its_report(stack, redis_url, tmp_path):
    args = "--concurrency 1,4 --seconds 2 --no-ceiling".split() + ["--scenarios", ""]
    result = run_benchmark("benchmarks.sweep", stack, redis_url, tmp_path, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [(r["system"], r["concurrency"]) for r in rows] == [
        ("platform", "1"),
        ("platform", "4"),
        ("naive", "1"),
        ("naive", "4"),
    ]
    assert all(int(r["requests"]) > 0 for r in rows)
    # The model's own CPU is counted for the platform's pool children, and for nothing of the naive server's.
    assert all(int(r["model_cpu_pct"]) > 0 for r in rows if r["system"] == "platform")
    assert all(r["model_cpu_pct"] == "" for r in rows if r["system"] == "naive")
    assert "| platform | 4 |" in (tmp_path / "sweep.md").read_text()
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
