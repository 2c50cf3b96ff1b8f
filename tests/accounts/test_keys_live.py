"""API keys on the live stack: the lean predict path, embeddings and the jobs API honour a key's scopes,
models and expiry, and a revoked key or a deactivated user's key is refused within seconds everywhere."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from datetime import timedelta

import pytest
import requests

from tests.conftest import wait_until

pytestmark = pytest.mark.integration

REFUSED_WITHIN_S = 5


@pytest.fixture
def owner(stack, django_db_blocker):
    """A user of their own, logged in through the login form: (user, session)."""
    from django.contrib.auth import get_user_model

    from tests.conftest import TESTER_PASSWORD

    with django_db_blocker.unblock():
        user = get_user_model().objects.create_user(username=f"keys-{uuid.uuid4().hex[:8]}", password=TESTER_PASSWORD)
    return user, stack.browser_login(user.username)


def _make_key(stack, session: requests.Session, **fields) -> dict:
    made = session.post(
        f"{stack.url}/api/v1/keys",
        json={"name": "test", **fields},
        headers={"X-CSRFToken": session.cookies["csrftoken"], "Referer": stack.url},
        timeout=10,
    )
    assert made.status_code == 201, made.text
    return made.json()


def _predict(stack, key: str, model: str = "router") -> requests.Response:
    return requests.post(
        f"{stack.url}/api/v1/models/{model}/predict",
        json={"inputs": ["where is my parcel"]},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def _embeddings(stack, key: str) -> requests.Response:
    return requests.post(
        f"{stack.url}/v1/embeddings",
        json={"model": "embedding", "input": "hello"},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def _jobs(stack, key: str) -> requests.Response:
    return requests.get(f"{stack.url}/api/v1/jobs", headers={"Authorization": f"Bearer {key}"}, timeout=10)


def _refused_within(what, timeout_s: float) -> float:
    started = time.monotonic()
    wait_until(lambda: what().status_code == 401, timeout_s, "the key to be refused", interval_s=0.2)
    return time.monotonic() - started


def test_a_revoked_key_is_refused_on_predict_within_5_s(stack, owner):
    _, session = owner
    key = _make_key(stack, session, scopes=["predict"])
    assert _predict(stack, key["key"]).status_code == 200  # now cached by the web process for 30 s
    revoked = session.delete(
        f"{stack.url}/api/v1/keys/{key['id']}",
        headers={"X-CSRFToken": session.cookies["csrftoken"], "Referer": stack.url},
        timeout=10,
    )
    assert revoked.status_code == 200 and revoked.json()["state"] == "revoked"
    assert _refused_within(lambda: _predict(stack, key["key"]), REFUSED_WITHIN_S) < REFUSED_WITHIN_S
    refused = _predict(stack, key["key"])
    assert refused.json()["code"] == "not_authenticated"


def test_a_deactivated_users_key_is_refused_everywhere(stack, owner):
    user, session = owner
    key = _make_key(stack, session)["key"]  # every scope
    assert _predict(stack, key).status_code == 200
    assert _embeddings(stack, key).status_code == 200
    assert _jobs(stack, key).status_code == 200
    done = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "shell",
            "-c",
            "from django.contrib.auth import get_user_model;"
            f"u = get_user_model().objects.get(pk={user.pk}); u.is_active = False; u.save()",
        ],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _refused_within(lambda: _predict(stack, key), REFUSED_WITHIN_S)
    assert _embeddings(stack, key).status_code == 401
    assert _jobs(stack, key).status_code == 401
    upload = requests.post(
        f"{stack.url}/api/v1/jobs",
        files={"file": ("a.csv", b"text\nhello\n")},
        data={"text_column": "text"},
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )
    assert upload.status_code == 401


def test_a_keys_scopes_and_models_hold_on_the_online_paths(stack, owner):
    _, session = owner
    router_only = _make_key(stack, session, scopes=["predict"], models_allowed=["router"])["key"]
    assert _predict(stack, router_only).status_code == 200
    other_model = _predict(stack, router_only, model="sentiment")
    assert other_model.status_code == 403 and other_model.json()["code"] == "model_not_allowed"
    no_embeddings = _embeddings(stack, router_only)
    assert no_embeddings.status_code == 403
    assert no_embeddings.json()["error"]["code"] == "scope_missing"  # OpenAI's error shape on /v1/
    assert _jobs(stack, router_only).status_code == 403
    embeddings_only = _make_key(stack, session, scopes=["embeddings"])["key"]
    assert _embeddings(stack, embeddings_only).status_code == 200
    refused = _predict(stack, embeddings_only)
    assert refused.status_code == 403 and "'predict' scope" in refused.json()["detail"]


def test_a_key_is_refused_once_it_expires_even_while_cached(stack, owner):
    from django.utils import timezone

    _, session = owner
    expires_at = timezone.now() + timedelta(seconds=3)
    key = _make_key(stack, session, scopes=["predict"], expires_at=expires_at.isoformat())["key"]
    assert _predict(stack, key).status_code == 200
    wait_until(lambda: _predict(stack, key).status_code == 401, 3 + REFUSED_WITHIN_S, "the expired key to be refused")
    assert timezone.now() >= expires_at
