"""benchmarks/overhead.py's pure parts: wrk's summary line, CPU per request, /proc/stat arithmetic, targets."""

from __future__ import annotations

import pytest

from benchmarks.overhead import Step, busy_idle, parse_wrk, per_request_us, targets

WRK_OUTPUT = """Running 5s test @ http://127.0.0.1:8300/api/v1/models/identity/predict
  1 threads and 32 connections
  Non-2xx or 3xx responses: 7
Requests/sec:    460.12
OVERHEAD_JSON {"requests":2307,"duration_us":5012345,"statuses":{"200":2300,"503":5,"429":2},"errors":{"connect":0,"read":1,"write":0,"timeout":2},"latency_us":{"p50":67230,"p90":88250,"p99":145820,"mean":69001.5,"max":190000}}
"""


def test_parse_wrk_reads_the_summary_line_and_counts_non_2xx_by_status():
    run = parse_wrk(WRK_OUTPUT)
    assert run.requests == 2307 and run.duration_us == 5012345
    assert run.ok == 2300
    assert run.non_2xx == 7
    assert run.statuses == {"200": 2300, "503": 5, "429": 2}
    assert run.socket_errors == 3
    assert run.latency_us["p50"] == 67230 and run.latency_us["p99"] == 145820


def test_parse_wrk_without_the_line_says_so():
    with pytest.raises(ValueError, match="OVERHEAD_JSON"):
        parse_wrk("Running 5s test\nunable to connect to 127.0.0.1:8300 Connection refused\n")


def test_per_request_us_divides_each_group_and_adds_a_total():
    out = per_request_us({"web": 1.5, "worker-main": 0.5, "loadgen": 0.02}, 1000)
    assert out == {"web": 1500, "worker-main": 500, "loadgen": 20, "total": 2020}


def test_per_request_us_with_nothing_answered_is_none():
    assert per_request_us({"web": 1.0}, 0) == {"web": None, "total": None}


def test_busy_idle_counts_iowait_as_idle_and_skips_guest_time():
    before = {"user": 10.0, "nice": 0.0, "system": 5.0, "idle": 100.0, "iowait": 1.0, "guest": 3.0}
    after = {"user": 14.0, "nice": 0.0, "system": 6.0, "idle": 104.0, "iowait": 2.0, "guest": 9.0}
    busy, idle = busy_idle(before, after)
    assert busy == pytest.approx(5.0)
    assert idle == pytest.approx(0.5)


def step(system: str, concurrency: int, rps: float, p50_ms: float, non_2xx: int = 0) -> Step:
    return Step(system, concurrency, rps, p50_ms, p50_ms, p50_ms, int(rps), non_2xx, 0, {}, 0.0, 1.0)


def test_targets_met_and_missed():
    steps = [step("naive", 1, 100, 3.0), step("platform", 1, 90, 4.5), step("naive", 32, 150, 80)]
    met = targets([*steps, step("platform", 32, 451, 60)])
    assert [ok for _, _, ok in met] == [True, True]
    missed = targets([*steps, step("platform", 32, 449, 60, non_2xx=0), step("platform", 64, 500, 90, non_2xx=1)])
    assert [ok for _, _, ok in missed] == [False, True]
    slow = targets([step("naive", 1, 100, 3.0), step("platform", 1, 400, 5.5)])
    assert slow[1][2] is False and "2.50 ms" in slow[1][1]
