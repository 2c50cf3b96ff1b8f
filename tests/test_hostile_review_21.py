"""Regression tests for bugs a hostile review of issue 21 (model versions, canaries, task plugins) confirmed.

Each is xfail(strict=True) while the bug stands: fixing it turns the test into an XPASS failure, and the
marker should then go.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from inference.core.versions import DEPLOYMENTS_KEY, Deployment
from tests.conftest import ROOT, own_redis_database
from tests.inference.test_versions import beat, fake_loads, keeper_for, mirrored, registry_of  # noqa: F401

DB = 4  # this module's own Redis database
PLUGINS = ROOT / "examples" / "plugins"


@pytest.fixture
def client(settings, redis_url, monkeypatch):
    yield from own_redis_database(settings, redis_url, monkeypatch, DB)


@pytest.fixture
def two_versions(monkeypatch):
    from inference import deployments

    registry = registry_of()
    monkeypatch.setattr(deployments, "get_registry", lambda: registry)
    return registry


def staff_api(name: str):
    from rest_framework.test import APIClient

    from tests.jobs.factories import user

    api = APIClient(raise_request_exception=False)
    api.force_authenticate(user(name, staff=True))
    return api


# ---- the staff deployment API -------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("post", "/api/v1/models/nope/promote", {"version": "1"}, 404),
        ("post", "/api/v1/models/router/promote", {"version": "9"}, 404),
        ("post", "/api/v1/models/router@2/promote", {"version": "2"}, 404),
        ("post", "/api/v1/models/router/canary", {"version": "1", "percent": 5}, 409),
        ("delete", "/api/v1/models/nope/canary", None, 404),
        ("get", "/api/v1/models/nope/deployment", None, 404),
    ],
)
def test_the_staff_apis_documented_refusals_are_4xx_not_500(client, two_versions, method, path, body, status):
    api = staff_api("ops-refusals")
    answer = getattr(api, method)(path, body, format="json") if body is not None else getattr(api, method)(path)
    assert answer.status_code == status, answer.content


@pytest.mark.django_db(transaction=True)
def test_a_staff_users_narrow_api_key_cannot_promote(client, two_versions):
    from rest_framework.test import APIClient

    from accounts.models import ApiKey
    from tests.jobs.factories import user

    staff = user("ops-staff", staff=True)
    _, raw = ApiKey.issue(staff, "read jobs only", ["jobs:read"], models_allowed=["embedding"])
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    answer = api.post("/api/v1/models/router/promote", {"version": "2"}, format="json")
    assert answer.status_code == 403, (answer.status_code, answer.content)


# ---- the Redis mirror -------------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_advance_repairs_a_stale_mirror(client, two_versions):
    from inference import deployments

    beat(client, "a", ["1", "2"])
    deployments.promote("router", "2", by="ops")
    client.hset(DEPLOYMENTS_KEY, "router", Deployment(model="router", active="1").as_json())  # the lost write
    for _ in range(3):
        deployments.advance(client)
    # The record of truth: promoted (and, every online child having it, switched by now).
    assert "2" in (deployments.current("router").target, deployments.current("router").active)
    assert mirrored(client).active == "2" or mirrored(client).target == "2", "the mirror was never repaired"


@pytest.mark.django_db(transaction=True)
def test_a_redis_blip_after_the_commit_is_not_a_500(client, two_versions, monkeypatch):
    import redis

    from inference import deployments

    def down(state, client=None):
        raise redis.ConnectionError("blip")

    monkeypatch.setattr(deployments, "mirror", down)
    answer = staff_api("ops-blip").post("/api/v1/models/router/promote", {"version": "2"}, format="json")
    assert answer.status_code != 500, answer.content


# ---- online requests to a version other than the models file's entry ------------------------------------------


def test_a_request_to_another_version_is_priced_by_that_versions_own_limits(monkeypatch):
    from inference.core.registry import parse_registry
    from inference.web import online

    entry = {
        "task": "embedding",
        "path": "a",
        "max_seq_length": 32,
        "versions": {"2": {"path": "b", "max_seq_length": 256}},
    }
    registry = parse_registry({"models": {"m": entry}}, device="cpu", torch_threads=1, max_backlog=100)
    seen = {}

    class Admission:
        async def capacity(self, model):
            return 0, 1000.0

        def alone_fits(self, rate, seconds):
            return 10**9

    def counts(spec, texts, stop_above=None):
        seen["spec"] = spec
        raise RuntimeError("priced")

    monkeypatch.setattr(online, "get_admission", lambda: Admission())
    monkeypatch.setattr(online, "get_registry", lambda: registry)  # the process's registry, this file's models
    monkeypatch.setattr(online, "token_counts", counts)
    with pytest.raises(RuntimeError, match="priced"):
        asyncio.run(online.predict(registry.get("m"), ["x"], 2000, "r", time.time(), client="1", version="2"))
    assert seen["spec"].max_seq_length == 256, "a call pinned to version 2 is priced with version 1's limits"


def test_pinned_calls_to_a_replaced_version_do_not_keep_it_loaded_forever(client, fake_loads, monkeypatch):  # noqa: F811
    from inference.child import runtime
    from inference.child import versions as child_versions

    registry = registry_of()
    monkeypatch.setattr(child_versions, "cached_checksum", lambda spec: f"digest-{spec.version}")
    keeper, state, _ = keeper_for(client, registry, drain_s=10)
    keeper.step(now=0.0)
    client.hset(DEPLOYMENTS_KEY, "router", Deployment(model="router", active="1", target="2", changed_at=1).as_json())
    keeper.step(now=1.0)
    client.hset(DEPLOYMENTS_KEY, "router", Deployment(model="router", active="2", previous="1", changed_at=2).as_json())
    for now in range(2, 300, 5):  # one tenant's `router@1` call every 5 s
        runtime._last_used[("router", "1")] = float(now)
        keeper.step(now=float(now))
    assert state.versions == {"router": ["2"]}, "a replaced version stays loaded as long as any tenant pins it"


# ---- the rerank plugin's documents cell ---------------------------------------------------------------------------


def test_a_deeply_nested_documents_cell_is_a_row_error_not_a_crash():
    sys.path.insert(0, str(PLUGINS))
    try:
        from inference.core.task_types import get_task_type

        task = get_task_type("rerank:RerankTask")
        cell = "[" * 5000 + "]" * 5000
        assert task.cells_error({"query": "q", "documents": cell}, 20_000)
    finally:
        sys.path.remove(str(PLUGINS))


@pytest.mark.django_db(transaction=True)
def test_a_csv_upload_with_a_deeply_nested_documents_cell_is_not_a_500(client, settings, tmp_path):
    import yaml
    from django.core.files.uploadedfile import SimpleUploadedFile
    from rest_framework.test import APIClient

    from inference.core.registry import get_registry
    from tests.jobs.factories import user

    sys.path.insert(0, str(PLUGINS))
    entry = {"task": "rerank:RerankTask", "path": "x"}
    (tmp_path / "models.yaml").write_text(yaml.safe_dump({"default": "reranker", "models": {"reranker": entry}}))
    settings.INFERENCE_MODELS_FILE = str(tmp_path / "models.yaml")
    get_registry.cache_clear()
    try:
        api = APIClient(raise_request_exception=False)
        api.force_authenticate(user("tenant"))
        cell = "[" * 3000 + "]" * 3000
        body = f'query,documents\nq,"{cell}"\n'.encode()
        upload = SimpleUploadedFile("r.csv", body, "text/csv")
        answer = api.post("/api/v1/jobs", {"model": "reranker", "file": upload}, format="multipart")
    finally:
        get_registry.cache_clear()
        sys.path.remove(str(PLUGINS))
    assert answer.status_code != 500, answer.content


# ---- job pins (finding 7) ------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_tenant_pins_a_job_only_to_a_served_version_and_staff_to_any(client, two_versions, monkeypatch):
    """A pinned job makes the shared offline worker load that version: a tenant may pin the active, canary
    or previous version, not make it load any version of the models file."""
    from types import SimpleNamespace

    from jobs.api import serializers as job_serializers
    from tests.jobs.factories import user

    monkeypatch.setattr(job_serializers, "get_registry", lambda: two_versions)

    def pin(who, value: str):
        form = job_serializers.JobCreateSerializer(context={"request": SimpleNamespace(user=who)})
        return form.validate_model(value)

    tenant, staff = user("pin-tenant"), user("pin-staff", staff=True)
    assert pin(tenant, "router@1") == "router@1"  # the active version
    with pytest.raises(job_serializers.serializers.ValidationError) as refused:
        pin(tenant, "router@2")
    assert "only while it is the active, canary or previous version; now: 1" in str(refused.value)
    assert pin(staff, "router@2") == "router@2"


def test_a_keys_model_allow_list_holds_for_a_pinned_version_of_an_allowed_model():
    from accounts.credentials import Caller

    caller = Caller(user=None, key_id=1, scopes=frozenset({"predict", "jobs:write"}), models_allowed=("router",))
    assert caller.refusal("jobs:write", "router@2") is None
    assert caller.refusal("predict", "embedding@1")[0] == "model_not_allowed"
