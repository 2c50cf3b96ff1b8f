"""The dispatch policy on its own: free children, per-model budgets, per-client fairness, wake-ups, expiry."""

from __future__ import annotations

from inference.dispatch.fair import FairDispatcher, Limits, Work

LIMITS = {"m": Limits(max_texts=32, max_tokens=4096, contended_tokens=256), "n": Limits(8, 1000, 100)}


def work(key, client="a", costs=(10,), model="m", at=0.0, deadline=None, divisible=True) -> Work:
    return Work(key, model, client, list(costs), at, deadline, divisible)


def keys(dispatch):
    return [(s.work.key, s.start, s.end) for s in dispatch]


def test_nothing_is_dispatched_without_a_free_child():
    d = FairDispatcher(LIMITS)
    d.add(work("r1"))
    assert d.plan(free_children=0, total_children=2, now_s=1.0).dispatches == []
    assert keys(d.plan(1, 2, 1.0).dispatches[0]) == [("r1", 0, 1)]
    assert len(d) == 0


def test_a_free_child_takes_its_share_of_what_waits_not_everything():
    d = FairDispatcher(LIMITS)
    for i in range(8):
        d.add(work(f"r{i}", at=i))
    first = d.plan(1, 2, 10.0).dispatches[0]
    assert [s.work.key for s in first] == ["r0", "r1", "r2", "r3"]  # 8 texts over 2 children, oldest first
    second = d.plan(1, 2, 10.0).dispatches[0]
    assert [s.work.key for s in second] == ["r4", "r5"]  # a share of the 4 left


def test_two_free_children_get_one_dispatch_each():
    d = FairDispatcher(LIMITS)
    for i in range(4):
        d.add(work(f"r{i}", at=i))
    plan = d.plan(2, 2, 10.0)
    assert [[s.work.key for s in x] for x in plan.dispatches] == [["r0", "r1"], ["r2"]]  # each a share


def test_text_and_token_budgets_of_the_model_hold():
    d = FairDispatcher(LIMITS)
    d.add(work("big", costs=[400] * 20, model="n"))  # one client: max_tokens 1000, max_texts 8
    dispatch = d.plan(1, 1, 1.0).dispatches[0]
    assert keys(dispatch) == [("big", 0, 2)]
    assert sum(s.cost for s in dispatch) <= 1000


def test_a_text_larger_than_the_whole_budget_still_runs_alone():
    d = FairDispatcher(LIMITS)
    d.add(work("huge", costs=[5000, 10], model="n"))
    assert keys(d.plan(1, 1, 1.0).dispatches[0]) == [("huge", 0, 1)]
    assert keys(d.plan(1, 1, 1.0).dispatches[0]) == [("huge", 1, 2)]


def test_a_light_client_is_served_next_behind_a_heavy_clients_backlog():
    d = FairDispatcher(LIMITS)
    for i in range(4):  # the heavy client queued first: 4 requests of 64 texts x 200 tokens
        d.add(work(f"heavy{i}", client="heavy", costs=[200] * 64, at=i))
    first = d.plan(1, 2, 10.0).dispatches[0]
    assert {s.work.key for s in first} == {"heavy0"}  # alone: a full budget
    d.add(work("light", client="light", costs=[12], at=11.0))
    second = d.plan(1, 2, 11.0).dispatches[0]
    assert second[0].work.key == "light"  # fewest tokens served goes first
    # ...and while two clients wait, a dispatch is cut to the contended budget
    assert sum(s.cost for s in second) <= 256 or len(second) == 1


def test_while_clients_contend_each_dispatch_stays_within_the_contended_budget():
    d = FairDispatcher(LIMITS)
    d.add(work("heavy", client="heavy", costs=[100] * 64))
    d.add(work("other", client="other", costs=[100] * 64))
    for _ in range(10):
        dispatch = d.plan(1, 2, 1.0).dispatches[0]
        assert sum(s.cost for s in dispatch) <= 256


def test_clients_alternate_by_tokens_served_not_by_requests():
    d = FairDispatcher({"m": Limits(max_texts=64, max_tokens=100, contended_tokens=100)})
    for i in range(10):
        d.add(work(f"h{i}", client="heavy", costs=[100], at=i))  # 100 tokens a request
    for i in range(40):
        d.add(work(f"l{i}", client="light", costs=[10], at=100 + i))  # 10 tokens a request
    served = {"heavy": 0, "light": 0}
    for _ in range(6):
        for s in d.plan(1, 1, 200.0).dispatches[0]:
            served[s.work.client] += s.cost
    assert abs(served["heavy"] - served["light"]) <= 100  # equal tokens, within one slice


def test_an_idle_client_does_not_bank_credit():
    d = FairDispatcher({"m": Limits(max_texts=1, max_tokens=100, contended_tokens=100)})
    for i in range(8):
        d.add(work(f"a{i}", client="a", costs=[10], at=i))
    for _ in range(5):
        d.plan(1, 1, 10.0)  # a, always backlogged, is served 50 tokens while b is away
    for i in range(3):
        d.add(work(f"b{i}", client="b", costs=[10], at=20 + i))
    order = [d.plan(1, 1, 30.0).dispatches[0][0].work.client for _ in range(6)]
    assert order == ["b", "a", "b", "a", "b", "a"]  # alternating: b did not get three turns in a row


def test_slices_of_one_request_cover_its_texts_exactly_once():
    d = FairDispatcher(LIMITS)
    d.add(work("r", costs=[300] * 10, model="n"))
    d.add(work("s", client="b", costs=[1] * 3, model="n"))
    seen = []
    while len(d):
        for s in d.plan(1, 1, 1.0).dispatches[0]:
            if s.work.key == "r":
                seen.extend(range(s.start, s.end))
    assert seen == list(range(10))


def test_indivisible_work_is_never_cut():
    d = FairDispatcher({"m": Limits(max_texts=100, max_tokens=100, contended_tokens=100)})
    d.add(work("chunk1", costs=[1] * 80, divisible=False))
    d.add(work("chunk2", costs=[1] * 80, divisible=False, at=1))
    first = d.plan(1, 1, 2.0).dispatches[0]
    assert keys(first) == [("chunk1", 0, 80)]
    assert keys(d.plan(1, 1, 2.0).dispatches[0]) == [("chunk2", 0, 80)]


def test_expired_work_is_dropped_not_dispatched():
    d = FairDispatcher(LIMITS)
    d.add(work("late", deadline=5.0))
    d.add(work("live", deadline=50.0, at=1))
    plan = d.plan(1, 1, 10.0)
    assert [w.key for w in plan.expired] == ["late"]
    assert keys(plan.dispatches[0]) == [("live", 0, 1)]


def test_a_lone_request_waits_for_company_then_goes():
    d = FairDispatcher(LIMITS, batch_wait_s=0.005)
    d.add(work("r", at=1.0))
    plan = d.plan(1, 1, 1.001)
    assert plan.dispatches == [] and abs(plan.wake_in_s - 0.004) < 1e-9
    assert keys(d.plan(1, 1, 1.006).dispatches[0]) == [("r", 0, 1)]


def test_a_full_batch_does_not_wait_for_company():
    d = FairDispatcher({"m": Limits(max_texts=2, max_tokens=100, contended_tokens=100)}, batch_wait_s=10.0)
    d.add(work("r1"))
    d.add(work("r2"))
    assert len(d.plan(1, 1, 0.0).dispatches) == 1


def test_each_dispatch_holds_one_model_oldest_first():
    d = FairDispatcher(LIMITS)
    d.add(work("n1", model="n", at=0.0))
    d.add(work("m1", model="m", at=1.0))
    plan = d.plan(2, 2, 5.0)
    assert [[s.work.model for s in x] for x in plan.dispatches] == [["n"], ["m"]]


def test_what_is_left_of_a_discarded_request_is_never_dispatched():
    d = FairDispatcher(LIMITS)
    big = work("big", costs=[300] * 10, model="n")
    d.add(big)
    d.add(work("other", client="b", costs=[1], model="n", at=1))
    d.plan(1, 1, 2.0)  # a first slice of "big" (or "other") goes
    d.discard(big)  # its caller got an error for a lost slice
    left = [s.work.key for _ in range(5) for x in d.plan(1, 1, 3.0).dispatches for s in x]
    assert "big" not in left and len(d) == 0


def test_a_request_with_no_texts_still_leaves_the_queue():
    d = FairDispatcher(LIMITS)
    d.add(work("empty", costs=[]))
    d.add(work("r", client="b", at=1))
    first = d.plan(1, 1, 2.0).dispatches[0]
    assert [s.work.key for s in first][0] == "empty"
    while len(d):
        d.plan(1, 1, 2.0)
