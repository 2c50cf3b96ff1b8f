"""Quotas and rates: token buckets and daily tokens in Redis, defaults from settings, staff overrides."""

from __future__ import annotations

import asyncio

import pytest

from accounts import quotas, usage
from accounts.models import ApiKey, Quota
from platform_.errors import ApiError

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice(make_user, own_redis):
    return make_user("alice")


def _admit(limits) -> ApiError | None:
    try:
        asyncio.run(quotas.admit(limits))
    except ApiError as error:
        return error
    return None


async def _priced(user_id: int, tokens: int) -> None:
    await usage.record(user_id, None, "router", inputs=1, tokens=tokens)
    await usage.write_pending()


def test_defaults_come_from_settings_and_zero_means_no_limit(alice, settings):
    settings.QUOTA_REQUESTS_PER_S, settings.QUOTA_BURST, settings.QUOTA_TOKENS_PER_DAY = 0, 20, 0
    limits = quotas.limits_for(alice, None)
    assert all(_admit(limits) is None for _ in range(50))
    settings.QUOTA_REQUESTS_PER_S, settings.QUOTA_BURST = 2.0, 3
    limits = quotas.limits_for(alice, None)
    assert [_admit(limits) is None for _ in range(4)] == [True, True, True, False]


def test_a_burst_past_the_rate_is_a_429_naming_the_limit_with_retry_after(alice):
    Quota.objects.create(user=alice, requests_per_s=0.5, burst=2)
    limits = quotas.limits_for(alice, None)
    assert _admit(limits) is None and _admit(limits) is None
    refused = _admit(limits)
    assert refused.status == 429 and refused.code == "rate_limited"
    assert refused.headers["Retry-After"] in ("1", "2")
    body = refused.response()
    assert b'"limit": {"name": "requests_per_s", "applies_to": "user", "value": 0.5}' in body.content
    assert "0.5 per second" in refused.detail


def test_a_keys_own_limit_refuses_without_spending_its_users_allowance(alice):
    key, _ = ApiKey.issue(alice, "small", ["predict"])
    Quota.objects.create(user=alice, requests_per_s=1, burst=3)
    Quota.objects.create(api_key=key, requests_per_s=0.1, burst=1)
    with_key = quotas.limits_for(alice, key.pk)
    assert _admit(with_key) is None
    refused = _admit(with_key)
    assert refused.code == "rate_limited" and refused.extra["limit"]["applies_to"] == "key"
    without_key = quotas.limits_for(alice, None)
    assert _admit(without_key) is None and _admit(without_key) is None  # 3 - 1: the refusal took nothing
    assert _admit(without_key).extra["limit"]["applies_to"] == "user"


def test_tokens_per_day_refuse_the_calls_after_the_one_that_crosses_it(alice):
    Quota.objects.create(user=alice, tokens_per_day=100)
    limits = quotas.limits_for(alice, None)
    assert _admit(limits) is None
    asyncio.run(_priced(alice.pk, tokens=120))  # the call, priced after it ran
    refused = _admit(limits)
    assert refused.status == 429 and refused.code == "daily_tokens_exceeded"
    assert refused.extra["limit"] == {"name": "tokens_per_day", "applies_to": "user", "value": 100}
    assert 1 <= int(refused.headers["Retry-After"]) <= 24 * 3600
    assert "midnight UTC" in refused.detail


def test_a_quota_is_for_a_user_or_a_key_not_both(alice):
    from django.db import IntegrityError, transaction

    key, _ = ApiKey.issue(alice, "k", ["predict"])
    with pytest.raises(IntegrityError), transaction.atomic():
        Quota.objects.create(user=alice, api_key=key, requests_per_s=1)
    with pytest.raises(IntegrityError), transaction.atomic():
        Quota.objects.create(requests_per_s=1)
