"""Quotas on the live stack: past a user's rate or daily tokens, predict and embeddings answer 429 with
Retry-After and the limit's name; staff lifting an override is seen within seconds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.accounts.test_keys_live import _embeddings, _make_key, _predict, owner  # noqa: F401  (fixture)
from tests.conftest import wait_until

pytestmark = pytest.mark.integration


def _quota(django_db_blocker, user, **limits) -> None:
    from accounts.models import Quota

    with django_db_blocker.unblock():
        Quota.objects.create(user=user, **limits)


def test_past_the_rate_a_call_gets_429_with_retry_after_and_the_limits_name(stack, owner, django_db_blocker):  # noqa: F811
    user, session = owner
    _quota(django_db_blocker, user, requests_per_s=0.2, burst=2)  # before any call: nothing cached yet
    key = _make_key(stack, session)["key"]
    assert [_predict(stack, key).status_code for _ in range(2)] == [200, 200]
    refused = _predict(stack, key)
    assert refused.status_code == 429, refused.text
    body = refused.json()
    assert body["code"] == "rate_limited"
    assert body["limit"] == {"name": "requests_per_s", "applies_to": "user", "value": 0.2}
    assert 1 <= int(refused.headers["Retry-After"]) <= 5
    embeddings = _embeddings(stack, key)  # the same user's allowance, in OpenAI's error shape
    assert embeddings.status_code == 429 and embeddings.json()["error"]["type"] == "rate_limit_error"
    # Staff lift the limit (0: none): every web process sees it within seconds, without a restart.
    done = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "shell",
            "-c",
            f"from accounts.models import Quota; q = Quota.objects.get(user_id={user.pk}); q.requests_per_s = 0; q.save()",
        ],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    wait_until(lambda: _predict(stack, key).status_code == 200, 5, "the lifted limit to apply")
    assert [_predict(stack, key).status_code for _ in range(3)] == [200, 200, 200]


def test_past_the_daily_tokens_a_call_gets_429_until_midnight(stack, owner, django_db_blocker):  # noqa: F811
    user, session = owner
    _quota(django_db_blocker, user, tokens_per_day=1)
    key = _make_key(stack, session)["key"]
    assert _predict(stack, key).status_code == 200  # the call that crosses the limit is answered
    # Its tokens reach the limit's counter with the web process's next write (USAGE_WRITE_S, 1 s).
    # (A list: a 429 Response is falsy, and wait_until waits for a truthy value.)
    refused = wait_until(lambda: (r := _predict(stack, key)).status_code == 429 and [r], 5, "the daily limit")[0]
    assert refused.json()["code"] == "daily_tokens_exceeded"
    assert refused.json()["limit"] == {"name": "tokens_per_day", "applies_to": "user", "value": 1}
    assert int(refused.headers["Retry-After"]) <= 24 * 3600
    assert _predict(stack, stack.token).status_code == 200  # another user is not affected
