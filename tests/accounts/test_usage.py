"""Usage metering: counters in Redis rolled into Usage rows, shown to each user only, exported by staff."""

from __future__ import annotations

import asyncio
import csv
import io

import pytest
from rest_framework.test import APIClient

from accounts import usage
from accounts.keys import USAGE_FLUSHING_PREFIX, usage_day_key
from accounts.models import ApiKey, Usage

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice(make_user, own_redis):
    user = make_user("alice")
    client = APIClient()
    client.force_login(user)
    client.user = user
    return client


def _count(user, key, model: str, calls: int, inputs: int, tokens: int) -> None:
    async def run():
        for _ in range(calls):
            await usage.record(user.pk, key.pk if key else None, model, inputs=inputs, tokens=tokens)
        await usage.write_pending()  # what the process's writer does every USAGE_WRITE_S

    asyncio.run(run())


def test_calls_are_counted_in_redis_and_rolled_into_rows_per_key_and_model(alice, own_redis):
    key, _ = ApiKey.issue(alice.user, "crawler", ["predict"])
    _count(alice.user, key, "router", calls=3, inputs=2, tokens=11)
    _count(alice.user, None, "router", calls=1, inputs=1, tokens=5)
    usage.record_job_rows(own_redis, {(alice.user.pk, None): 40}, "sentiment")
    assert Usage.objects.count() == 0  # nothing in the database per request
    assert usage.flush() == 3
    assert not own_redis.keys(usage_day_key("*")) and not own_redis.keys(
        USAGE_FLUSHING_PREFIX + "*"
    )  # the counters moved, none left behind
    rows = {(r.api_key_id, r.model): r for r in Usage.objects.all()}
    assert (rows[key.pk, "router"].requests, rows[key.pk, "router"].inputs, rows[key.pk, "router"].tokens) == (3, 6, 33)
    assert (rows[None, "router"].requests, rows[None, "router"].tokens) == (1, 5)
    assert rows[None, "sentiment"].job_rows == 40
    # A second flush adds to the same rows.
    _count(alice.user, key, "router", calls=1, inputs=2, tokens=11)
    usage.flush()
    assert Usage.objects.get(api_key=key).requests == 4


def test_counts_made_while_a_flush_reads_are_not_lost(alice, own_redis):
    _count(alice.user, None, "router", calls=2, inputs=1, tokens=3)
    day_key = own_redis.keys(usage_day_key("*"))[0]
    real_write = usage._write

    def write_while_counting(day, counters):
        _count(alice.user, None, "router", calls=5, inputs=1, tokens=3)  # lands in a fresh hash
        return real_write(day, counters)

    usage._write = write_while_counting
    try:
        usage.flush()
    finally:
        usage._write = real_write
    assert own_redis.exists(day_key)
    usage.flush()
    assert Usage.objects.get().requests == 7


def test_a_user_sees_only_their_own_usage_with_totals(alice, make_user):
    bob = make_user("bob")
    key, _ = ApiKey.issue(alice.user, "crawler", ["predict"])
    _count(alice.user, key, "router", calls=2, inputs=1, tokens=4)
    _count(bob, None, "router", calls=9, inputs=9, tokens=99)
    usage.flush()
    body = alice.get("/api/v1/usage").json()
    assert body["totals"] == {"requests": 2, "inputs": 2, "tokens": 8, "job_rows": 0}
    assert [(r["model"], r["key_name"], r["key_prefix"]) for r in body["rows"]] == [("router", "crawler", key.prefix)]
    page = alice.get("/usage/")
    assert page.status_code == 200 and b"crawler" in page.content and b"99" not in page.content


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ("start=yesterday", "YYYY-MM-DD"),
        ("start=2026-02-01&end=2026-01-01", "start is after end"),
        ("start=2000-01-01", "at most"),
    ],
)
def test_a_bad_period_is_a_clear_400(alice, query, said):
    refused = alice.get(f"/api/v1/usage?{query}")
    assert refused.status_code == 400 and said in refused.json()["detail"]
    page = alice.get(f"/usage/?{query}")
    assert page.status_code == 400 and said.encode() in page.content


def test_staff_export_everyones_usage_as_csv(alice, make_user, client):
    staff = make_user("boss", is_staff=True, is_superuser=True)
    _count(alice.user, None, "router", calls=2, inputs=1, tokens=4)
    usage.flush()
    client.force_login(staff)
    ids = [str(pk) for pk in Usage.objects.values_list("pk", flat=True)]
    exported = client.post("/admin/accounts/usage/", {"action": "export_csv", "_selected_action": ids})
    assert exported.status_code == 200 and exported["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(exported.content.decode())))
    assert [(r["username"], r["model"], r["requests"], r["tokens"]) for r in rows] == [("alice", "router", "2", "8")]
    assert client.get("/admin/accounts/usage/").status_code == 200
    assert client.get("/admin/accounts/apikey/add/").status_code == 200


def test_metrics_show_tokens_per_model_not_per_key(alice):
    from observability.prometheus import render

    families = list(usage.metric_families({"usage_tokens|router": 42.0, "usage_inputs|router": 7.0}, {}))
    text = render({"usage_tokens|router": 42.0}, {})
    assert 'platform_usage_tokens_total{model="router"} 42.0' in text
    assert all(sample.labels.keys() == {"model"} for family in families for sample in family.samples)


def test_calls_are_summed_in_the_process_and_written_in_one_go(alice, own_redis):
    async def run():
        for _ in range(50):
            await usage.record(alice.user.pk, None, "router", inputs=2, tokens=7)
        before = own_redis.keys(usage_day_key("*"))
        await usage.write_pending()
        return before

    assert asyncio.run(run()) == []  # nothing in Redis per call
    usage.flush()
    row = Usage.objects.get()
    assert (row.requests, row.inputs, row.tokens) == (50, 100, 350)
