"""Credentials that stop working stop at once on every path, the cached predict path included; a user
can replace their own token; `Bearer` works wherever `Token` does (issue #25), live on the stack."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest
import requests

from tests.conftest import wait_until

pytestmark = pytest.mark.integration

# AUTH_REVOCATION_CHECK_S is 1 s: a revoked credential must be refused well within the 30 s token cache.
REFUSED_WITHIN_S = 5


@pytest.fixture
def member(stack, django_db_blocker):
    """A user of their own with a token: (user, token key)."""
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    with django_db_blocker.unblock():
        user = get_user_model().objects.create_user(username=f"member-{uuid.uuid4().hex[:8]}", password="x" * 12)
        return user, Token.objects.create(user=user).key


def _predict(stack, key: str, scheme: str = "Token") -> requests.Response:
    return requests.post(
        f"{stack.url}/api/v1/models/router/predict",
        json={"inputs": ["where is my parcel"]},
        headers={"Authorization": f"{scheme} {key}"},
        timeout=30,
    )


def _embeddings(stack, key: str) -> requests.Response:
    return requests.post(
        f"{stack.url}/v1/embeddings",
        json={"model": "embedding", "input": "hello"},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def _operator(stack, code: str) -> None:
    """Run Django code as an operator would (`manage.py shell`), with the stack's settings: its Redis too."""
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code], env=stack.env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _refused_within(what, timeout_s: float) -> float:
    started = time.monotonic()
    wait_until(lambda: what().status_code == 401, timeout_s, "the revoked credential to be refused", interval_s=0.2)
    return time.monotonic() - started


def test_a_deactivated_users_token_is_refused_on_predict_and_embeddings_within_seconds(stack, member):
    user, key = member
    assert _predict(stack, key).status_code == 200  # now cached by the web process for 30 s
    assert _embeddings(stack, key).status_code == 200
    _operator(
        stack,
        "from django.contrib.auth import get_user_model;"
        f"u = get_user_model().objects.get(pk={user.pk}); u.is_active = False; u.save()",
    )
    assert _refused_within(lambda: _predict(stack, key), REFUSED_WITHIN_S) < REFUSED_WITHIN_S
    assert _embeddings(stack, key).status_code == 401
    assert (
        requests.get(f"{stack.url}/api/v1/jobs", headers={"Authorization": f"Token {key}"}, timeout=10).status_code
        == 401
    )


def test_a_deleted_users_token_is_refused_on_predict_within_seconds(stack, member):
    user, key = member
    assert _predict(stack, key).status_code == 200
    _operator(
        stack, f"from django.contrib.auth import get_user_model; get_user_model().objects.get(pk={user.pk}).delete()"
    )
    _refused_within(lambda: _predict(stack, key), REFUSED_WITHIN_S)


def test_a_user_replaces_their_token_and_the_old_one_stops_everywhere(stack, member):
    _, old = member
    assert _predict(stack, old).status_code == 200
    rotated = requests.post(f"{stack.url}/api/v1/token/rotate", headers={"Authorization": f"Token {old}"}, timeout=10)
    assert rotated.status_code == 201, rotated.text
    new = rotated.json()["token"]
    assert new != old and len(new) == 40
    _refused_within(lambda: _predict(stack, old), REFUSED_WITHIN_S)
    assert (
        requests.get(f"{stack.url}/api/v1/jobs", headers={"Authorization": f"Token {old}"}, timeout=10).status_code
        == 401
    )
    assert _predict(stack, new).status_code == 200
    assert (
        requests.get(f"{stack.url}/api/v1/jobs", headers={"Authorization": f"Token {new}"}, timeout=10).status_code
        == 200
    )


def test_rotating_needs_credentials(stack):
    answer = requests.post(f"{stack.url}/api/v1/token/rotate", timeout=10)
    assert answer.status_code == 401, answer.text


def test_bearer_works_for_uploads_as_token_does(stack, member):
    _, key = member
    answer = requests.post(
        f"{stack.url}/api/v1/jobs",
        files={"file": ("rows.csv", b"text\nwhere is my parcel\n", "text/csv")},
        data={"text_column": "text", "model": "router"},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert answer.status_code == 202, answer.text
    assert _predict(stack, key, scheme="Bearer").status_code == 200


def test_concurrent_rotations_leave_one_current_key_and_no_error(stack, member):
    from concurrent.futures import ThreadPoolExecutor

    _, old = member

    def rotate(_: int) -> requests.Response:
        return requests.post(f"{stack.url}/api/v1/token/rotate", headers={"Authorization": f"Token {old}"}, timeout=30)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(rotate, range(4)))
    statuses = sorted(answer.status_code for answer in answers)
    assert statuses.count(201) == 1, [(a.status_code, a.text[:100]) for a in answers]
    assert set(statuses) <= {201, 409, 429, 401}, statuses  # 401: the old key was gone before it was looked up
    new = next(answer.json()["token"] for answer in answers if answer.status_code == 201)
    assert _predict(stack, new).status_code == 200


def test_a_revocation_is_announced_only_once_it_is_committed(db, django_capture_on_commit_callbacks):
    """Announced inside the transaction, a web process could re-read the not yet committed (still valid)
    token and trust it for the whole cache time."""
    from django.contrib.auth import get_user_model

    from inference.web.api import auth

    user = get_user_model().objects.create_user(username="revoked-later", password="x" * 12)
    with django_capture_on_commit_callbacks(execute=False) as announced:
        user.is_active = False
        user.save()
    assert auth._bump_revocations in announced
