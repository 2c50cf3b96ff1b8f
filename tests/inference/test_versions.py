"""Model versions without a live stack (issue 21): the models file's versions, checksums, the sticky
canary choice, the deployment's promote/switch/rollback/canary records, and a child's version keeper."""

from __future__ import annotations

import json
import shutil
import time
from types import SimpleNamespace

import pytest

from inference.child import runtime
from inference.child import versions as child_versions
from inference.core.keys import DISPATCHERS_KEY, WORKERS_KEY
from inference.core.registry import RegistryError, parse_registry
from inference.core.versions import (
    DEPLOYMENTS_KEY,
    DIGESTS_KEY,
    Deployment,
    checksum,
    choose_version,
    deployments_from,
    split_pin,
)
from inference.core.workers import WorkerState
from tests.conftest import own_redis_database

DEFAULTS = {"device": "cpu", "torch_threads": 1, "max_backlog": 100}
DB = 3  # this module's own Redis database (deployment mirror, heartbeats, digests)


def registry_of(extra: dict | None = None):
    entry = {"task": "router", "path": "a", "routes": "r1.yaml", "versions": {2: {"path": "b", "routes": "r2.yaml"}}}
    return parse_registry({"models": {"router": {**entry, **(extra or {})}}}, **DEFAULTS)


# ---- the models file ---------------------------------------------------------------------------------------


def test_an_entry_is_version_1_and_versions_override_its_keys():
    registry = registry_of({"sha256": "ab" * 32})
    one, two = registry.version_spec("router", "1"), registry.version_spec("router", "2")
    assert (one.version, one.path, one.routes, one.sha256) == ("1", "a", "r1.yaml", "ab" * 32)
    # A version's own files: the entry's checksum is of another folder, so it is not inherited.
    assert (two.version, two.path, two.routes, two.sha256) == ("2", "b", "r2.yaml", None)
    assert (two.task, two.online_queue) == (one.task, one.online_queue)
    assert registry.get("router") is one and registry.version_spec("router", None) is one
    assert registry.version_spec("router", "3") is None and sorted(registry.versions_of("router")) == ["1", "2"]


@pytest.mark.parametrize(
    ("versions", "message"),
    [
        ({"2": {"task": "embedding"}}, "keys not allowed here ['task']"),
        ({"2": {"queue": "online.x"}}, "keys not allowed here ['queue']"),
        ({"a@b": {}}, "must be 1-32 letters"),
        ({"1": {"path": "c"}}, "given twice"),
    ],
)
def test_version_mistakes_are_named(versions, message):
    raw = {"models": {"m": {"task": "embedding", "path": "x", "versions": versions}}}
    with pytest.raises(RegistryError) as caught:
        parse_registry(raw, **DEFAULTS)
    assert message in str(caught.value)


def test_a_pin_is_split_at_the_at_sign():
    assert split_pin("router@2") == ("router", "2") and split_pin("router") == ("router", None)


def test_the_checksum_covers_names_and_contents_and_survives_a_copy(tmp_path):
    folder = tmp_path / "v1"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bin").write_bytes(b"weights")
    (folder / "sub" / "b.json").write_text("{}")
    first = checksum(folder)
    shutil.copytree(folder, tmp_path / "copy")
    assert checksum(tmp_path / "copy") == first
    (folder / "a.bin").write_bytes(b"weightz")
    assert checksum(folder) != first
    (folder / "a.bin").write_bytes(b"weights")
    (folder / "a.bin").rename(folder / "c.bin")
    assert checksum(folder) != first


# ---- the sticky canary ---------------------------------------------------------------------------------------


def test_a_canary_takes_its_share_of_callers_and_each_caller_sticks():
    deployment = Deployment(model="router", active="1", canary="2", canary_percent=10, canary_ready=True)
    chosen = [choose_version(deployment, str(user)) for user in range(5000)]
    assert 0.08 <= chosen.count("2") / len(chosen) <= 0.12
    assert all(choose_version(deployment, str(user)) == chosen[user] for user in range(5000))
    # Not before every child has it loaded, and never for a model without one.
    assert choose_version(Deployment(model="router", active="1", canary="2", canary_percent=100), "7") == "1"


def test_a_mirror_naming_a_version_the_file_lacks_is_ignored():
    registry = registry_of()
    raw = {"router": Deployment(model="router", active="9").as_json()}
    assert deployments_from(raw, registry)["router"].active == "1"
    raw = {"router": Deployment(model="router", active="2", previous="1").as_json()}
    assert deployments_from(raw, registry)["router"].active == "2"


# ---- promote, switch, rollback, canary (the database is the record of truth) -----------------------------


@pytest.fixture
def client(settings, redis_url, monkeypatch):
    yield from own_redis_database(settings, redis_url, monkeypatch, DB)


@pytest.fixture
def two_versions(monkeypatch):
    from inference import deployments

    registry = registry_of()
    monkeypatch.setattr(deployments, "get_registry", lambda: registry)
    return registry


def beat(
    client, worker: str, versions: list[str], *, queue: str = "online", errors: dict | None = None, seen: float = 1e12
) -> None:
    """A live child (and its live dispatcher) serving router with `versions` loaded, its keeper having acted
    on the deployment changed at `seen` (default: any change so far)."""
    now = time.time()
    entry = {
        "worker_id": worker,
        "queue": queue,
        "models": ["router"],
        "dispatcher": f"d-{worker}",
        "versions": {"router": versions},
        "version_errors": errors or {},
        "versions_seen": {"router": seen},
        "ts": now,
    }
    client.hset(WORKERS_KEY, worker, json.dumps(entry))
    client.hset(DISPATCHERS_KEY, f"d-{worker}", json.dumps({"queue": queue, "ts": now}))


def mirrored(client) -> Deployment:
    return Deployment.from_json(client.hget(DEPLOYMENTS_KEY, "router"))


@pytest.mark.django_db(transaction=True)
def test_promote_switches_only_when_every_child_has_the_target_then_rolls_back(client, two_versions):
    from inference import deployments
    from inference.models import ModelVersion

    beat(client, "a", ["1"])
    beat(client, "b", ["1"])
    # An offline child still loading it does not hold up the switch (its jobs run on their pinned version).
    beat(client, "offline", ["1"], queue="offline")
    state = deployments.promote("router", "2", by="ops")
    assert (state.active, state.target) == ("1", "2") and mirrored(client).target == "2"
    assert ModelVersion.objects.get(model="router", version="2").status == "loading"
    beat(client, "a", ["1", "2"])
    assert deployments.advance(client) == [] and mirrored(client).active == "1", "child b has not loaded it"
    beat(client, "b", ["1", "2"])
    assert deployments.advance(client) == ["switched router 1->2"]
    assert (mirrored(client).active, mirrored(client).previous, mirrored(client).target) == ("2", "1", None)
    statuses = dict(ModelVersion.objects.filter(model="router").values_list("version", "status"))
    assert statuses == {"1": "retired", "2": "active"}
    # Rollback is a promote of `previous`; 1 is still loaded (draining), so it switches at once.
    deployments.promote("router", deployments.current("router").previous, by="ops")
    assert deployments.advance(client) == ["switched router 2->1"]
    assert (mirrored(client).active, mirrored(client).previous) == ("1", "2")


@pytest.mark.django_db(transaction=True)
def test_a_refused_version_fails_and_the_active_one_serves_on(client, two_versions):
    from inference import deployments
    from inference.models import ModelVersion

    state = deployments.promote("router", "2", by="ops")
    refusal = {"router@2": {"error": "checksum mismatch for router@2", "changed_at": state.changed_at}}
    beat(client, "a", ["1"], errors=refusal)
    assert deployments.advance(client) == ["failed router@2"]
    assert (mirrored(client).active, mirrored(client).target) == ("1", None)
    row = ModelVersion.objects.get(model="router", version="2")
    assert (row.status, row.error) == ("failed", "checksum mismatch for router@2")
    # A refusal from an earlier promote does not fail a new one (the files may have been fixed).
    deployments.promote("router", "2", by="ops")
    assert deployments.advance(client) == [] and mirrored(client).target == "2"


@pytest.mark.django_db(transaction=True)
def test_a_canary_opens_once_loaded_and_redis_losing_the_mirror_loses_nothing(client, two_versions):
    from inference import deployments

    beat(client, "a", ["1"])
    deployments.set_canary("router", "2", 10, by="ops")
    assert not mirrored(client).canary_ready
    beat(client, "a", ["1", "2"])
    assert deployments.advance(client) == ["canary router@2 ready"]
    assert mirrored(client).canary_ready and mirrored(client).canary_percent == 10
    client.delete(DEPLOYMENTS_KEY)
    deployments.advance(client)
    assert mirrored(client).canary == "2", "re-mirrored from the database"
    deployments.clear_canary("router", by="ops")
    assert mirrored(client).canary is None
    with pytest.raises(deployments.DeploymentError, match="no version '7'"):
        deployments.promote("router", "7")


# ---- a child's keeper ---------------------------------------------------------------------------------------


@pytest.fixture
def fake_loads(monkeypatch):
    """runtime.load_one without weights: a version 'loads' as a stand-in handler holding its spec."""
    monkeypatch.setattr(runtime, "_versions", {})
    monkeypatch.setattr(runtime, "_handlers", {})
    monkeypatch.setattr(runtime, "_last_used", {})

    def load_one(spec, build=None):
        handler = SimpleNamespace(spec=spec)
        runtime._versions[(spec.name, spec.version)] = handler
        return handler

    monkeypatch.setattr(runtime, "load_one", load_one)


def keeper_for(client, registry, *, drain_s: float = 60.0):
    state = WorkerState(queue="online", models=["router"])
    beats = []
    keeper = child_versions.VersionKeeper(
        client, registry, ["router"], state, lambda: beats.append(dict(state.versions)), poll_s=0.5, drain_s=drain_s
    )
    return keeper, state, beats


def test_the_keeper_loads_a_target_beside_the_active_and_unloads_the_old_once_drained(client, fake_loads, monkeypatch):
    registry = registry_of()
    monkeypatch.setattr(child_versions, "cached_checksum", lambda spec: f"digest-{spec.version}")
    keeper, state, beats = keeper_for(client, registry, drain_s=30)
    keeper.step(now=0.0)
    assert state.versions == {"router": ["1"]}
    client.hset(DEPLOYMENTS_KEY, "router", Deployment(model="router", active="1", target="2", changed_at=1).as_json())
    keeper.step(now=1.0)
    assert state.versions == {"router": ["1", "2"]} and beats[-1] == {"router": ["1", "2"]}
    assert client.hget(DIGESTS_KEY, "router@2") == "digest-2", "the first load records the digest"
    switched = Deployment(model="router", active="2", previous="1", changed_at=2)
    client.hset(DEPLOYMENTS_KEY, "router", switched.as_json())
    keeper.step(now=2.0)
    assert runtime.handler_for("router").spec.version == "2", "the default follows the active version"
    keeper.step(now=31.0)
    assert state.versions == {"router": ["1", "2"]}, "version 1 drains first"
    keeper.step(now=32.5)
    assert state.versions == {"router": ["2"]}


def test_the_keeper_refuses_a_version_whose_files_changed_and_keeps_serving(client, fake_loads, monkeypatch):
    registry = registry_of()
    monkeypatch.setattr(child_versions, "cached_checksum", lambda spec: f"digest-{spec.version}")
    client.hset(DIGESTS_KEY, "router@2", "recorded-at-an-earlier-load")
    keeper, state, _ = keeper_for(client, registry)
    keeper.step(now=0.0)
    client.hset(DEPLOYMENTS_KEY, "router", Deployment(model="router", active="1", target="2", changed_at=5).as_json())
    keeper.step(now=1.0)
    assert state.versions == {"router": ["1"]}
    assert "checksum mismatch for router@2" in state.version_errors["router@2"]["error"]
    assert state.version_errors["router@2"]["changed_at"] == 5
    with pytest.raises(runtime.VersionNotLoaded, match="loaded: \\['1'\\]"):
        runtime.handler_for("router", "2")


def test_an_offline_child_loads_a_jobs_version_on_demand_and_keeps_at_most_two_extra(client, fake_loads, monkeypatch):
    raw = {"task": "embedding", "path": "a", "versions": {v: {"path": v} for v in ("2", "3", "4")}}
    registry = parse_registry({"models": {"router": raw}}, **DEFAULTS)
    monkeypatch.setattr(child_versions, "cached_checksum", lambda spec: f"digest-{spec.version}")
    keeper, state, _ = keeper_for(client, registry)
    keeper.step(now=0.0)
    for version in ("2", "3", "4"):
        keeper.ensure("router", version)
        runtime._last_used[("router", version)] = time.monotonic()
    # The active version stays; of the others, the least recently used went first.
    assert state.versions == {"router": ["1", "3", "4"]}
    with pytest.raises(child_versions.VersionRefused, match="no version '9'"):
        keeper.ensure("router", "9")


# ---- jobs: pinned at creation, moved by staff ----------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_job_pins_the_active_version_and_staff_may_move_it(client, two_versions, monkeypatch):
    from inference import deployments
    from jobs import versions as job_versions
    from jobs.models import Job, JobStatus
    from tests.jobs.factories import user

    monkeypatch.setattr(job_versions, "get_registry", lambda: two_versions)
    owner = user("pinner")
    before = Job.objects.create(owner=owner, model="router", status=JobStatus.QUEUED)
    assert before.model_version == "1"
    beat(client, "a", ["1", "2"])
    deployments.promote("router", "2", by="ops")
    deployments.advance(client)
    after = Job.objects.create(owner=owner, model="router", status=JobStatus.QUEUED)
    pinned = Job.objects.create(owner=owner, model="router", model_version="1", status=JobStatus.QUEUED)
    before.refresh_from_db()
    assert (before.model_version, after.model_version, pinned.model_version) == ("1", "2", "1")
    assert job_versions.model_and_version("router@1") == ("router", "1")
    with pytest.raises(job_versions.UnknownVersion, match="no version '9'"):
        job_versions.model_and_version("router@9")
    done = Job.objects.create(owner=owner, model="router", model_version="1", status=JobStatus.SUCCEEDED)
    assert job_versions.move([before, done]) == 1, "a finished job keeps the version it ran on"
    before.refresh_from_db()
    done.refresh_from_db()
    assert (before.model_version, done.model_version) == ("2", "1")


@pytest.mark.django_db(transaction=True)
def test_staff_move_unfinished_jobs_to_a_version_from_the_admin(client, two_versions, monkeypatch):
    from django.test import Client

    from jobs import admin as jobs_admin
    from jobs import versions as job_versions
    from jobs.models import Job, JobStatus
    from tests.jobs.factories import user

    monkeypatch.setattr(job_versions, "get_registry", lambda: two_versions)
    monkeypatch.setattr(jobs_admin, "get_registry", lambda: two_versions)
    staff = user("mover", staff=True)
    job = Job.objects.create(owner=staff, model="router", status=JobStatus.RUNNING)
    browser = Client()
    browser.force_login(staff)
    answer = browser.post(
        "/admin/jobs/job/", {"action": "move_to_version_2", "_selected_action": [job.pk]}, follow=True
    )
    assert answer.status_code == 200 and "1 job(s) moved to model version 2" in answer.content.decode()
    job.refresh_from_db()
    assert job.model_version == "2"


@pytest.mark.django_db(transaction=True)
def test_staff_promote_from_the_admin(client, two_versions):
    from django.test import Client

    from inference.models import ModelVersion
    from tests.jobs.factories import user

    browser = Client()
    browser.force_login(user("operator", staff=True))
    assert browser.get("/admin/inference/modelversion/").status_code == 200  # lists the file's versions
    two = ModelVersion.objects.get(model="router", version="2")
    answer = browser.post(
        "/admin/inference/modelversion/", {"action": "promote", "_selected_action": [two.pk]}, follow=True
    )
    shown = [str(m) for m in answer.context["messages"]]
    assert "promoted: router active 1, target 2" in shown, shown
    assert mirrored(client).target == "2"
    # Its action list renders (a bare % in an action's description would break the page).
    assert "10% canary" in browser.get("/admin/inference/modelversion/").content.decode()


@pytest.mark.django_db(transaction=True)
def test_a_switch_waits_for_children_to_report_after_the_change_not_before(client, two_versions):
    """A rollback promoted while a child still reported the old version it was about to unload switched at
    once and sent the requests to a child without it (CI: 1,486 of 2,241 answers 409). A report counts only
    once the child's keeper has acted on the change."""
    from inference import deployments

    state = deployments.promote("router", "2", by="ops")
    beat(client, "a", ["1", "2"], seen=state.changed_at - 1)  # reported before it saw the promote
    assert deployments.advance(client) == [] and deployments.current("router").active == "1"
    beat(client, "a", ["1", "2"], seen=state.changed_at)  # its keeper acted on the promote
    deployments.advance(client)
    assert deployments.current("router").active == "2"
