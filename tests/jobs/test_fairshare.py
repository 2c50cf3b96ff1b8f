"""The offline fair-share policy alone (jobs/fairshare.py): who gets the next chunk, with no database or broker.

Every figure asserted here follows from start-time fair queuing (SFQ): a flow that becomes busy starts
at the virtual time (the start tag of the work last handed out), so it is served before every flow
already ahead of it; and between two busy flows the service each got, divided by its weight, differs
by at most one chunk's cost per flow (Goyal et al.'s bound). Tolerances below are that bound in picks.
"""

from __future__ import annotations

import copy
import json
import random
from collections import Counter

import pytest

from jobs.fairshare import DEFAULT_BAND_WEIGHTS, JobQueue, ShareState, forecast, pick

BIG = 10_000  # chunks: a job no test finishes


def queue(
    job_id: int,
    owner: str,
    *,
    band: str = "normal",
    weight: float = 1.0,
    chunks: int = BIG,
    cost: float = 100.0,
    rows: float = 128.0,
) -> JobQueue:
    return JobQueue(job_id, owner, band, weight, chunks, cost, rows)


def owners(picks) -> list:
    return [p.owner for p in picks]


def jobs(picks) -> list[int]:
    return [p.job_id for p in picks]


def longest_gap(sequence: list, value) -> int:
    """Most consecutive picks that were not `value`, counted from the first pick."""
    gap = longest = 0
    for item in sequence:
        gap = 0 if item == value else gap + 1
        longest = max(longest, gap)
    return longest


def through_json(state: ShareState) -> ShareState:
    """What the scheduler does between calls: the state goes to a JSON column and back."""
    return ShareState.from_json(json.loads(json.dumps(state.as_json())))


# Starvation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flood",
    [
        pytest.param(lambda: [queue(1, "A")], id="one job of 10,000 chunks"),
        pytest.param(lambda: [queue(n, "A", chunks=300) for n in range(1, 51)], id="50 jobs"),
        pytest.param(lambda: [queue(1, "A", weight=100.0, cost=1.0)], id="heavy weight, cheap chunks"),
    ],
)
def test_a_users_single_chunk_is_the_next_pick_after_another_users_flood(flood):
    # Bound: 0 chunks of waiting. B becomes busy at the virtual time, which is A's current start tag;
    # A's next start is that plus cost / weight, strictly later, so B goes next whatever A's weight.
    state = ShareState()
    flooded = flood()
    assert set(owners(pick(state, flooded, 2_000))) == {"A"}
    state = through_json(state)
    b = queue(999, "B", chunks=1)
    assert jobs(pick(state, [*flooded, b], 1)) == [999]
    assert set(owners(pick(state, [*flooded, b], 50))) == {"A"}  # and B's job is done: A gets the rest


def test_two_users_arriving_together_both_start_within_two_picks():
    # Bound when neither is ahead: ties go to the older job, so the newer waits one pick.
    assert sorted(owners(pick(ShareState(), [queue(1, "A"), queue(2, "B")], 2))) == ["A", "B"]


# Shares between users ------------------------------------------------------------------------------


def test_weights_two_to_one_give_two_picks_to_one():
    picks = owners(pick(ShareState(), [queue(1, "A", weight=2.0), queue(2, "B", weight=1.0)], 3_000))
    counts = Counter(picks)
    # SFQ bound: |picks_A / 2 - picks_B / 1| <= 1/2 + 1, so picks_A is 2,000 within 2.
    assert abs(counts["A"] - 2_000) <= 2, counts
    # and the share holds over any stretch, not only on average: B is never more than 2 picks away
    assert longest_gap(picks, "B") <= 2


def test_a_user_whose_chunks_cost_four_times_the_tokens_gets_a_quarter_of_the_chunks():
    counts = Counter(owners(pick(ShareState(), [queue(1, "A", cost=400.0), queue(2, "B", cost=100.0)], 5_000)))
    # Equal tokens: A's 1,000 chunks of 400 against B's 4,000 of 100, within one chunk of each.
    assert abs(counts["A"] - 1_000) <= 2, counts
    assert abs(counts["B"] - 4_000) <= 2, counts


def test_splitting_work_into_many_jobs_does_not_buy_a_user_a_bigger_share():
    many = [queue(n, "A") for n in range(1, 11)]
    counts = Counter(owners(pick(ShareState(), [*many, queue(99, "B")], 1_000)))
    assert abs(counts["A"] - 500) <= 1, counts


# Priority bands --------------------------------------------------------------------------------------


def test_high_takes_about_95_percent_and_normal_still_advances():
    picks = pick(ShareState(), [queue(1, "A", band="high"), queue(2, "B", band="normal")], 4_200)
    bands = [p.band for p in picks]
    counts = Counter(bands)
    # Weights 400:20 with equal costs: 4,000 and 200 of 4,200 picks (95.2%), within a chunk each.
    assert abs(counts["high"] - 4_000) <= 2, counts
    assert counts["normal"] >= 198
    # No starvation: a normal chunk at least once every 20 high ones (400 / 20), plus one for the start.
    assert longest_gap(bands, "normal") <= 21


def test_low_still_advances_beside_high_and_normal():
    busy = [queue(1, "A", band="high"), queue(2, "B", band="normal"), queue(3, "C", band="low")]
    bands = [p.band for p in pick(ShareState(), busy, 4_210)]
    counts = Counter(bands)
    # 1 of every 421 picks: 10 of 4,210, with high and normal keeping their 400:20.
    assert abs(counts["low"] - 10) <= 1, counts
    assert abs(counts["high"] - 4_000) <= 3, counts
    assert longest_gap(bands, "low") <= 422


def test_band_weights_are_the_callers():
    busy = [queue(1, "A", band="high"), queue(2, "B", band="normal")]
    counts = Counter(p.band for p in pick(ShareState(), busy, 300, {"high": 2.0, "normal": 1.0, "low": 1.0}))
    assert abs(counts["high"] - 200) <= 2, counts


def test_the_same_user_in_two_bands_gets_each_bands_share():
    busy = [queue(1, "A", band="high"), queue(2, "A", band="normal"), queue(3, "B", band="normal")]
    picks = pick(ShareState(), busy, 4_200)
    counts = Counter(p.job_id for p in picks)
    assert abs(counts[1] - 4_000) <= 2
    assert abs(counts[2] - counts[3]) <= 1  # A's normal job shares the normal band with B's as any other user


# Jobs of one user ------------------------------------------------------------------------------------


def test_a_users_new_small_job_is_picked_at_once_beside_their_huge_job():
    state = ShareState()
    huge = queue(1, "A")
    pick(state, [huge], 500)
    small = queue(2, "A", chunks=1)
    assert jobs(pick(state, [huge, small], 1)) == [2]


def test_with_another_user_busy_a_users_new_small_job_goes_at_the_users_next_turn():
    state = ShareState()
    huge, other = queue(1, "A"), queue(5, "B")
    pick(state, [huge, other], 501)
    small = queue(9, "A", chunks=1)
    # Within two picks: B may be due first, then it is A's turn, and A's new job is ahead of A's huge one.
    assert 9 in jobs(pick(state, [huge, other, small], 2))


def test_a_users_jobs_share_the_users_turns_round_robin_by_cost():
    busy = [queue(1, "A", cost=200.0), queue(2, "A", cost=100.0), queue(3, "B")]
    counts = Counter(jobs(pick(ShareState(), busy, 1_400)))
    # A and B get equal tokens (A's 200 * n1 + 100 * n2 against B's 100 * n3), and A's two jobs split A's
    # tokens equally: job 1's chunks cost twice job 2's, so it gets half as many (200, 400 and 800 picks).
    assert abs(counts[1] - 200) <= 2 and abs(counts[2] - 400) <= 2 and abs(counts[3] - 800) <= 3, counts


# Work conserving -------------------------------------------------------------------------------------


@pytest.mark.parametrize("band", ["high", "normal", "low"])
def test_a_lone_job_gets_every_pick_whatever_its_band(band):
    lone = queue(1, "A", band=band, chunks=5, weight=0.01)
    assert jobs(pick(ShareState(), [lone], 3)) == [1, 1, 1]
    assert lone.chunks == 2


def test_fewer_picks_than_asked_only_when_every_queue_is_empty():
    busy = [queue(1, "A", chunks=3), queue(2, "B", band="low", chunks=2), queue(3, "C", chunks=0)]
    state = ShareState()
    assert len(pick(state, busy, 4)) == 4
    assert len(pick(state, busy, 4)) == 1
    assert pick(state, busy, 4) == []
    assert [q.chunks for q in busy] == [0, 0, 0]


# State between calls ---------------------------------------------------------------------------------


def mixed_backlog() -> list[JobQueue]:
    return [
        queue(1, "A", chunks=900),
        queue(2, "A", chunks=40, cost=300.0),
        queue(3, "B", weight=2.0, chunks=700),
        queue(4, "C", band="high", chunks=30),
        queue(5, "D", band="low", chunks=500, cost=50.0),
        queue(6, 7, weight=0.5, chunks=60),  # an owner as the scheduler gives it: a user id
    ]


def test_picks_split_across_calls_with_the_state_stored_between_equal_one_long_run():
    whole = jobs(pick(ShareState(), mixed_backlog(), 2_000))
    rng = random.Random(19)
    left = {q.job_id: q.chunks for q in mixed_backlog()}
    stored: dict = {}
    split: list[int] = []
    while len(split) < 2_000:
        # Each refill rebuilds the queues from the database and the state from its JSON column.
        queues = [
            queue(q.job_id, q.owner, band=q.band, weight=q.weight, chunks=left[q.job_id], cost=q.cost_per_chunk)
            for q in mixed_backlog()
        ]
        state = ShareState.from_json(json.loads(json.dumps(stored)))
        got = pick(state, queues, min(rng.randint(1, 7), 2_000 - len(split)))
        for p in got:
            left[p.job_id] -= 1
        split.extend(jobs(got))
        stored = state.as_json()
    assert split == whole


def test_a_stored_state_is_a_snapshot_that_later_picks_do_not_change():
    state = ShareState()
    backlog = mixed_backlog()
    pick(state, backlog, 100)
    stored = state.as_json()
    expected = jobs(pick(state, backlog, 100))  # picking goes on with the live state...
    again = [copy.copy(q) for q in backlog]
    for job_id in expected:  # ...from the same queues as before those picks
        next(q for q in again if q.job_id == job_id).chunks += 1
    assert jobs(pick(ShareState.from_json(stored), again, 100)) == expected


# Idleness --------------------------------------------------------------------------------------------


def test_users_gone_idle_are_forgotten():
    state = ShareState()
    a = queue(1, "A")
    for n in range(100):  # a hundred users each run a one-chunk job beside A and leave
        pick(state, [a, queue(100 + n, f"U{n}", chunks=1)], 2)
    pick(state, [a], 10)
    # Only A's flows are left: the state the scheduler stores on every pick does not grow with every user seen.
    assert set(state.users) == {"normal"} and set(state.users["normal"].finish) <= {"A"}
    assert set(state.jobs) == {"normal/A"}


def test_a_user_back_from_idleness_gets_a_fair_share_not_a_burst_of_catching_up():
    state = ShareState()
    a = queue(1, "A")
    pick(state, [a, queue(2, "B", chunks=10)], 20)  # B's first job, beside A
    pick(state, [a], 1_000)  # B idle while A runs alone
    returning = owners(pick(state, [a, queue(3, "B")], 100))
    assert abs(returning.count("B") - 50) <= 1
    assert "B,B" not in ",".join(returning)  # never two in a row: no credit for the idle time


def test_a_user_who_ran_alone_is_not_punished_when_another_arrives():
    state = ShareState()
    a = queue(1, "A")
    pick(state, [a], 1_000)
    after = owners(pick(state, [a, queue(2, "B")], 100))
    assert abs(after.count("A") - 50) <= 1
    assert longest_gap(after, "A") <= 1


# Forecast --------------------------------------------------------------------------------------------


def replay(state: ShareState, queues: list[JobQueue]) -> dict[int, tuple[int, float, float]]:
    """Each job's (chunks before its first pick, others' rows before its last, rows until its last) from the
    real pick order."""
    rows_of = {q.job_id: q.rows_per_chunk for q in queues}
    order = jobs(pick(copy.deepcopy(state), copy.deepcopy(queues), 10**9))
    out = {}
    for job_id in rows_of:
        first, last = order.index(job_id), len(order) - 1 - order[::-1].index(job_id)
        until = sum(rows_of[j] for j in order[: last + 1])
        own = sum(rows_of[j] for j in order[: last + 1] if j == job_id)
        out[job_id] = (first, until - own, until)
    return out


def test_forecast_tells_each_job_what_the_picks_will_do():
    state = ShareState()
    backlog = [
        queue(1, "A", chunks=300, rows=128),
        queue(2, "A", chunks=5, rows=20),
        queue(3, "B", weight=2.0, chunks=200, rows=100),
        queue(4, "C", band="high", chunks=40, rows=128, cost=500.0),
        queue(5, "D", band="low", chunks=3, rows=7),
    ]
    pick(state, backlog, 37)  # a state with history, as the scheduler's is
    told = forecast(state, backlog)
    actual = replay(state, backlog)
    assert {j: (f.chunks_ahead, f.rows_ahead, f.rows_to_finish) for j, f in told.items()} == actual


def test_forecast_changes_neither_the_state_nor_the_queues():
    state = ShareState()
    backlog = mixed_backlog()
    pick(state, backlog, 50)
    before = (json.dumps(state.as_json()), [copy.copy(q) for q in backlog])
    forecast(state, backlog)
    assert (json.dumps(state.as_json()), backlog) == before


def big_backlog(state: ShareState) -> list[JobQueue]:
    """Two users' big jobs running for a while, then a third user's three-chunk job: more chunks than
    the forecast replays one at a time."""
    backlog = [queue(1, "A", chunks=15_000), queue(2, "C", chunks=15_000, rows=100)]
    pick(state, backlog, 500)
    return [*backlog, queue(3, "B", chunks=3, rows=20)]


def test_forecast_of_a_big_backlog_is_exact_for_a_small_job_near_the_front():
    # The small job finishes within the first picks: its ETA must not be off by the big jobs' grouping
    # (replayed in groups of 20 chunks, it was told it goes first with nothing ahead, not after 4 chunks).
    state = ShareState()
    backlog = big_backlog(state)
    told = forecast(state, backlog)[3]
    assert (told.chunks_ahead, told.rows_ahead, told.rows_to_finish) == replay(state, backlog)[3]


def test_forecast_of_a_big_backlog_places_big_jobs_within_three_percent():
    state = ShareState()
    backlog = big_backlog(state)
    told = forecast(state, backlog)
    actual = replay(state, backlog)
    for job_id in (1, 2):
        first, rows_ahead, rows_to_finish = actual[job_id]
        assert told[job_id].chunks_ahead == first
        assert told[job_id].rows_to_finish == pytest.approx(rows_to_finish, rel=0.03), job_id
        assert told[job_id].rows_ahead == pytest.approx(rows_ahead, rel=0.03), job_id


@pytest.mark.parametrize(("users", "small"), [(40, 30), (10, 300)])
def test_forecast_of_a_full_platform_places_a_new_users_job_as_the_picks_will(users, small):
    # Every user at the default queued-rows quota (2,000,000 rows: 15,625 chunks), twelve chunks each done.
    state = ShareState()
    full = [queue(n, f"U{n}", chunks=15_625) for n in range(1, users + 1)]
    pick(state, full, users * 12)
    told = forecast(state, [*full, queue(10_000, "B", chunks=small)])
    # Equal costs and weights: B's first chunk goes at once (it starts at the virtual time), then B is last
    # of every round of users + 1 (ties go to older jobs), so its last chunk is pick 1 + (small - 1) * (users + 1).
    finish = 1 + (small - 1) * (users + 1)
    assert told[10_000].chunks_ahead == 0
    assert told[10_000].rows_to_finish == pytest.approx(finish * 128, rel=0.03)
    assert told[10_000].rows_ahead == pytest.approx((finish - small) * 128, rel=0.03)
    # The first user's job ends in the last round: all but the other users' last chunks before it.
    everything = users * (15_625 - 12) + small
    assert told[1].rows_to_finish == pytest.approx((everything - users + 1) * 128, rel=0.03)


def test_forecast_of_an_empty_backlog_is_empty():
    assert forecast(ShareState(), [queue(1, "A", chunks=0)], DEFAULT_BAND_WEIGHTS) == {}
