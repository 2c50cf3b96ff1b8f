"""API keys through DRF's views: made and revoked by their user, scoped, tenant-isolated, shown once."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from accounts import lastused
from accounts.keys import LAST_USED_KEY
from accounts.models import ApiKey
from tests.accounts.conftest import key_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice(make_user, own_redis):
    user = make_user("alice")
    client = APIClient()
    client.force_login(user)
    client.user = user
    return client


def test_a_user_makes_a_key_sees_its_secret_once_and_lists_it_by_prefix(alice):
    made = alice.post("/api/v1/keys", {"name": "crawler", "scopes": ["predict", "jobs:read"]}, format="json")
    assert made.status_code == 201, made.content
    body = made.json()
    assert body["key"].startswith("ipk_") and body["key"].startswith(body["prefix"])
    assert body["scopes"] == ["predict", "jobs:read"] and body["state"] == "active"
    listed = alice.get("/api/v1/keys").json()
    assert [k["name"] for k in listed] == ["crawler"]
    assert "key" not in listed[0] and body["key"] not in str(listed)  # the secret is not stored or shown again
    assert ApiKey.objects.get().secret_sha256 != body["key"]


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"name": "x", "scopes": ["admin"]}, "scopes"),
        ({"name": "x", "scopes": []}, "at least one scope"),
        ({"name": "x", "models_allowed": ["no-such-model"]}, "unknown models no-such-model"),
        ({"name": "x", "expires_at": "2001-01-01T00:00:00Z"}, "must be in the future"),
        ({"scopes": ["predict"]}, "name"),
    ],
)
def test_a_bad_key_request_is_a_clear_400(alice, given, said):
    refused = alice.post("/api/v1/keys", given, format="json")
    assert refused.status_code == 400
    assert said in refused.json()["detail"]


def test_a_key_reads_jobs_only_with_its_scope_and_never_manages_keys(alice):
    _, reader = ApiKey.issue(alice.user, "reader", ["jobs:read"])
    _, predictor = ApiKey.issue(alice.user, "predictor", ["predict"])
    assert key_client(reader).get("/api/v1/jobs").status_code == 200
    refused = key_client(predictor).get("/api/v1/jobs")
    assert refused.status_code == 403
    assert refused.json() == {
        "detail": "this API key (" + predictor[:12] + "…) lacks the 'jobs:read' scope",
        "code": "scope_missing",
    }
    writing = key_client(reader).post("/api/v1/jobs", {}, format="json")
    assert writing.status_code == 403 and "'jobs:write'" in writing.json()["detail"]
    # A leaked key cannot mint keys or turn itself into the account's full-access token.
    assert key_client(reader).post("/api/v1/keys", {"name": "more"}, format="json").status_code == 403
    assert key_client(reader).get("/api/v1/keys").status_code == 403
    assert key_client(reader).post("/api/v1/token/rotate").status_code == 403


def test_revoked_expired_and_deactivated_keys_are_refused_with_401(alice, make_user):
    key, raw = ApiKey.issue(alice.user, "soon", ["jobs:read"])
    assert key_client(raw).get("/api/v1/jobs").status_code == 200
    revoked = alice.delete(f"/api/v1/keys/{key.pk}")
    assert revoked.status_code == 200 and revoked.json()["state"] == "revoked"
    refused = key_client(raw).get("/api/v1/jobs")
    assert refused.status_code == 401 and refused.json()["code"] == "authentication_failed"

    expired, raw = ApiKey.issue(alice.user, "expired", ["jobs:read"], expires_at=timezone.now() + timedelta(hours=1))
    ApiKey.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert key_client(raw).get("/api/v1/jobs").status_code == 401

    bob = make_user("bob")
    _, raw = ApiKey.issue(bob, "bob's", ["jobs:read"])
    bob.is_active = False
    bob.save()
    assert key_client(raw).get("/api/v1/jobs").status_code == 401


def test_a_user_sees_and_revokes_only_their_own_keys(alice, make_user):
    bob = make_user("bob")
    bobs, _ = ApiKey.issue(bob, "bob's", ["predict"])
    assert alice.get("/api/v1/keys").json() == []
    assert alice.get(f"/api/v1/keys/{bobs.pk}").status_code == 404
    assert alice.delete(f"/api/v1/keys/{bobs.pk}").status_code == 404
    assert alice.delete("/api/v1/keys/not-a-number").status_code == 404
    bobs.refresh_from_db()
    assert bobs.state == "active"


def test_the_account_token_keeps_working_with_every_scope(alice):
    token = Token.objects.create(user=alice.user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    assert client.get("/api/v1/jobs").status_code == 200
    assert client.post("/api/v1/keys", {"name": "from token"}, format="json").status_code == 201


def test_last_used_is_noted_in_redis_and_written_by_the_flush(alice, own_redis):
    key, raw = ApiKey.issue(alice.user, "used", ["jobs:read"])
    lastused._noted_at.clear()
    assert key_client(raw).get("/api/v1/jobs").status_code == 200
    assert key_client(raw).get("/api/v1/jobs").status_code == 200
    assert list(own_redis.hkeys(LAST_USED_KEY)) == [str(key.pk)]  # one note, not one per request
    key.refresh_from_db()
    assert key.last_used_at is None  # no database write on the request
    assert lastused.flush() == 1
    key.refresh_from_db()
    assert abs((timezone.now() - key.last_used_at).total_seconds()) < 60
    assert alice.get("/api/v1/keys").json()[0]["last_used_at"] is not None


def test_the_keys_page_makes_a_key_shows_it_once_and_revokes_it(alice):
    page = alice.get("/keys/")
    assert page.status_code == 200 and b"No keys yet" in page.content
    made = alice.post("/keys/", {"name": "laptop", "scopes": ["predict"], "expires_in_days": "30"})
    key = ApiKey.objects.get()
    assert made.status_code == 200 and b"Copy it now" in made.content and key.prefix.encode() in made.content
    assert key.expires_at is not None and key.scopes == ["predict"]
    again = alice.get("/keys/")
    assert b"Copy it now" not in again.content and b"laptop" in again.content
    revoked = alice.post(f"/keys/{key.pk}/revoke/", follow=True)
    assert b"is revoked" in revoked.content
    key.refresh_from_db()
    assert key.state == "revoked"


def test_the_keys_page_needs_a_login(client):
    assert client.get("/keys/").status_code == 302


def test_a_keys_model_allow_list_holds_for_its_jobs(alice):
    from django.core.files.uploadedfile import SimpleUploadedFile

    _, raw = ApiKey.issue(alice.user, "router jobs", ["jobs:write", "jobs:read"], models_allowed=["router"])
    upload = SimpleUploadedFile("a.csv", b"text\nhello\n", content_type="text/csv")
    refused = key_client(raw).post(
        "/api/v1/jobs", {"file": upload, "text_column": "text", "model": "embedding"}, format="multipart"
    )
    assert refused.status_code == 403
    assert refused.json()["code"] == "model_not_allowed" and "may call only router" in refused.json()["detail"]


def test_staff_make_a_key_for_a_user_in_the_admin_and_see_its_secret_once(make_user, client, own_redis):
    staff = make_user("boss", is_staff=True, is_superuser=True)
    bob = make_user("bob")
    client.force_login(staff)
    made = client.post(
        "/admin/accounts/apikey/add/",
        {"user": bob.pk, "name": "bob's ci", "scopes": ["predict", "jobs:read"], "models_allowed": "[]"},
        follow=True,
    )
    assert made.status_code == 200
    key = ApiKey.objects.get(user=bob)
    shown = [str(m) for m in made.context["messages"]]
    secret = next(m for m in shown if "copy it now" in m).split(": ")[1].split(" ")[0]
    assert secret.startswith(key.prefix) and key.scopes == ["predict", "jobs:read"]
    assert key_client(secret).get("/api/v1/jobs").status_code == 200
    client.post("/admin/accounts/apikey/", {"action": "revoke", "_selected_action": [key.pk]})
    key.refresh_from_db()
    assert key.state == "revoked" and key_client(secret).get("/api/v1/jobs").status_code == 401


def test_a_user_holds_at_most_api_keys_per_user_active_keys(alice, settings):
    settings.API_KEYS_PER_USER = 2
    for name in ("a", "b"):
        assert alice.post("/api/v1/keys", {"name": name}, format="json").status_code == 201
    refused = alice.post("/api/v1/keys", {"name": "c"}, format="json")
    assert refused.status_code == 409 and refused.json()["code"] == "too_many_keys"
    page = alice.post("/keys/", {"name": "c", "scopes": ["predict"]})
    assert b"revoke one first" in page.content and ApiKey.objects.count() == 2
    alice.delete(f"/api/v1/keys/{ApiKey.objects.first().pk}")  # a revoked key makes room
    assert alice.post("/api/v1/keys", {"name": "c"}, format="json").status_code == 201
