"""Promote, roll back and canary model versions: the plain functions the admin, the staff API and
`manage.py models` call, and the switch the housekeeping tick makes once every child is ready.

The ModelDeployment row is the record of truth; every change here is written to it first, then to the
Redis mirror (inference/core/versions.py) that the web tier and worker children read. A promote only
names a target: children load it beside the active version (inference/child/versions.py), and when
every live online child serving the model reports it loaded (LoadedVersions.ready_for says why not
the offline ones), `advance` switches: active becomes the target
and the old active becomes `previous`, which a rollback promotes by the same path. The web tier stamps
each request with the version it chose, so requests already given the old version finish on it; the
old version is unloaded by each child once it has drained.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

import redis
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from inference.core.keys import DISPATCHERS_KEY, WORKERS_KEY
from inference.core.registry import Registry, get_registry
from inference.core.versions import (
    DEPLOYMENTS_KEY,
    DIGESTS_KEY,
    Deployment,
    LoadedVersions,
    default_deployment,
    loaded_versions,
)
from inference.core.workers import serving_workers
from inference.models import ModelDeployment, ModelVersion, VersionStatus
from platform_.redis import get_redis

logger = logging.getLogger(__name__)


class DeploymentError(Exception):
    """A promote or canary that cannot be done as asked: `status` and `code` are the API's answer."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def check_version(model: str, version: str, registry: Registry | None = None) -> None:
    """404 for a model or version the models file does not name."""
    registry = registry or get_registry()
    if registry.get(model) is None:
        raise DeploymentError(
            404, "unknown_model", f"unknown model {model!r}; served models: {', '.join(registry.names())}"
        )
    known = registry.versions_of(model)
    if version not in known:
        raise DeploymentError(
            404,
            "unknown_version",
            f"model {model!r} has no version {version!r}; its versions: {', '.join(sorted(known))}",
        )


def as_state(row: ModelDeployment) -> Deployment:
    return Deployment(
        model=row.model,
        active=row.active,
        target=row.target or None,
        previous=row.previous or None,
        canary=row.canary or None,
        canary_percent=row.canary_percent,
        canary_ready=row.canary_ready,
        changed_at=row.changed_at.timestamp(),
        changed_by=row.changed_by,
    )


def current(model: str) -> Deployment:
    """The model's deployment from its row; with no row, its models file entry's version alone."""
    row = ModelDeployment.objects.filter(model=model).first()
    if row is not None:
        return as_state(row)
    spec = get_registry().get(model)
    if spec is None:
        raise DeploymentError(404, "unknown_model", f"unknown model {model!r}")
    return default_deployment(spec)


def active_version(model: str) -> str:
    """The version new work of `model` goes to (a job pins it when created); "" for an unknown model."""
    try:
        return current(model).active
    except DeploymentError:
        return ""


def ensure_versions(registry: Registry | None = None) -> None:
    """A ModelVersion row for every version the models file names (path and declared sha256 kept current)."""
    registry = registry or get_registry()
    existing = {(v.model, v.version): v for v in ModelVersion.objects.all()}
    actives = dict(ModelDeployment.objects.values_list("model", "active"))
    for name in registry.names():
        active = actives.get(name, registry.models[name].version)
        for version, spec in registry.versions_of(name).items():
            row = existing.get((name, version))
            if row is None:
                status = VersionStatus.ACTIVE if version == active else VersionStatus.AVAILABLE
                ModelVersion.objects.create(
                    model=name, version=version, path=spec.path, sha256=spec.sha256 or "", status=status
                )
            elif row.path != spec.path or (spec.sha256 and row.sha256 != spec.sha256):
                row.path, row.sha256 = spec.path, spec.sha256 or row.sha256
                row.save(update_fields=["path", "sha256", "updated_at"])


def _locked_row(model: str) -> ModelDeployment:
    spec = get_registry().models[model]
    row, _ = ModelDeployment.objects.select_for_update().get_or_create(
        model=model, defaults={"active": spec.version, "changed_at": timezone.now()}
    )
    return row


def _set_status(model: str, version: str, status: str, error: str = "") -> None:
    fields: dict[str, Any] = {"status": status, "error": error[:500], "updated_at": timezone.now()}
    if status == VersionStatus.ACTIVE:
        fields["activated_at"] = timezone.now()
    ModelVersion.objects.filter(model=model, version=version).update(**fields)


def mirror(state: Deployment, client: redis.Redis | None = None) -> None:
    (client or get_redis()).hset(DEPLOYMENTS_KEY, state.model, state.as_json())


def _save(row: ModelDeployment, by: str) -> Deployment:
    row.changed_at, row.changed_by = timezone.now(), by[:150]
    row.save()
    state = as_state(row)
    # After the commit: a reader never sees a mirror the database then rolls back. Robust: the change is
    # recorded; a Redis error here is logged, not the caller's 500, and `advance` repairs the mirror.
    transaction.on_commit(lambda: mirror(state), robust=True)
    return state


def promote(model: str, version: str, by: str = "") -> Deployment:
    """Make `version` the model's target: children load it beside the active one, and `advance` switches
    to it when every live child has. Promoting the active version cancels a pending target; promoting
    `previous` is a rollback. Returns the deployment as now recorded."""
    check_version(model, version)
    ensure_versions()
    with transaction.atomic():
        row = _locked_row(model)
        if version == row.active:
            if row.target:
                _set_status(model, row.target, VersionStatus.AVAILABLE)
            row.target = ""
        else:
            if row.target and row.target != version:
                _set_status(model, row.target, VersionStatus.AVAILABLE)
            row.target = version
            _set_status(model, version, VersionStatus.LOADING)
        state = _save(row, by)
    logger.info("%s promoted %s@%s (active %s)", by or "someone", model, version, state.active)
    return state


def set_canary(model: str, version: str, percent: float, by: str = "") -> Deployment:
    """Give `version` a sticky `percent` of the model's online callers once every child has it loaded."""
    check_version(model, version)
    if not 0 < percent <= 100:
        raise DeploymentError(400, "invalid_value", f"percent must be above 0 and at most 100, got {percent}")
    ensure_versions()
    with transaction.atomic():
        row = _locked_row(model)
        if version == row.active:
            raise DeploymentError(409, "already_active", f"version {version!r} of {model!r} is the active one")
        if row.canary and row.canary != version:
            _set_status(model, row.canary, VersionStatus.AVAILABLE)
        row.canary_ready = row.canary == version and row.canary_ready
        row.canary, row.canary_percent = version, float(percent)
        _set_status(model, version, VersionStatus.CANARY)
        state = _save(row, by)
    logger.info("%s set a %.1f%% canary of %s@%s", by or "someone", percent, model, version)
    return state


def clear_canary(model: str, by: str = "") -> Deployment:
    """Stop the model's canary: all its callers go to the active version again."""
    if get_registry().get(model) is None:
        raise DeploymentError(404, "unknown_model", f"unknown model {model!r}")
    with transaction.atomic():
        row = _locked_row(model)
        if row.canary and row.canary != row.active and row.canary != row.target:
            _set_status(model, row.canary, VersionStatus.AVAILABLE)
        row.canary, row.canary_percent, row.canary_ready = "", 0.0, False
        return _save(row, by)


def live_workers(client: redis.Redis) -> list[dict[str, Any]]:
    return serving_workers(
        client.hgetall(WORKERS_KEY),
        client.hgetall(DISPATCHERS_KEY),
        settings.WORKER_HEARTBEAT_S,
        settings.DISPATCHER_HEARTBEAT_S,
    )


def advance(client: redis.Redis | None = None) -> list[str]:
    """One housekeeping step (every second, under the sampler's lock; and `promote --wait`): re-mirror
    deployments Redis lost or holds stale, switch targets every live online child has loaded, open ready canaries, and fail
    versions children refused. Returns what it did, for logs and `--wait`."""
    client = client or get_redis()
    registry = get_registry()
    raw = client.hgetall(DEPLOYMENTS_KEY)
    # The rows, not the mirror, say what is pending: a mirror write lost after its commit (a Redis blip,
    # or two commits' callbacks landing in the other order) is repaired here, a second later at most.
    # One small query a second, under the sampler's lock: one process in the fleet makes it.
    rows = {row.model: as_state(row) for row in ModelDeployment.objects.filter(model__in=registry.names())}
    pending = {}
    for name in registry.names():
        state = rows.get(name) or default_deployment(registry.models[name])
        if raw.get(name) != state.as_json():
            mirror(state, client)
        if state.target or (state.canary and not state.canary_ready):
            pending[name] = state
    if not pending:
        return []
    workers = live_workers(client)
    done = []
    for name, state in pending.items():
        loaded = loaded_versions(workers, name, since=state.changed_at)
        done += _fail_refused(state, loaded)
        if state.target and loaded.ready_for(state.target):
            done.append(switch(name, state.target))
        elif state.canary and not state.canary_ready and loaded.ready_for(state.canary):
            done.append(_canary_ready(name, state.canary))
    return [d for d in done if d]


def _fail_refused(state: Deployment, loaded: LoadedVersions) -> list[str]:
    """A target or canary some child refused for this very change (checksum mismatch, load error) fails:
    its status says why, and the deployment drops it so the active version serves on alone."""
    done = []
    for version in {state.target, state.canary} - {None}:
        refusal = loaded.errors.get(version)
        if not refusal or refusal.get("changed_at") != state.changed_at:
            continue
        with transaction.atomic():
            row = _locked_row(state.model)
            if row.target == version:
                row.target = ""
            if row.canary == version:
                row.canary, row.canary_percent, row.canary_ready = "", 0.0, False
            _set_status(state.model, version, VersionStatus.FAILED, refusal.get("error", ""))
            _save(row, "housekeeping")
        logger.error("%s@%s failed on a worker and is not served: %s", state.model, version, refusal.get("error"))
        done.append(f"failed {state.model}@{version}")
    return done


def switch(model: str, version: str) -> str:
    """Make the loaded target active (the old active becomes `previous`); "" when it is no longer the target."""
    with transaction.atomic():
        row = _locked_row(model)
        if row.target != version:
            return ""
        old = row.active
        row.previous, row.active, row.target = old, version, ""
        if row.canary == version:
            row.canary, row.canary_percent, row.canary_ready = "", 0.0, False
        _set_status(model, version, VersionStatus.ACTIVE)
        _set_status(model, old, VersionStatus.RETIRED)
        _save(row, row.changed_by)
    logger.info("switched %s from version %s to %s", model, old, version)
    return f"switched {model} {old}->{version}"


def _canary_ready(model: str, version: str) -> str:
    with transaction.atomic():
        row = _locked_row(model)
        if row.canary != version:
            return ""
        row.canary_ready = True
        _save(row, row.changed_by)
    return f"canary {model}@{version} ready"


def wait_for(model: str, version: str, timeout_s: float, poll_s: float = 0.5) -> Deployment:
    """Advance until `version` is active (a promote's switch) or no longer the target (it failed), or the
    timeout; the deployment as it then is."""
    deadline = time.monotonic() + timeout_s
    while True:
        advance()
        state = current(model)
        if state.target != version or time.monotonic() >= deadline:
            return state
        time.sleep(poll_s)


def persist_digests(client: redis.Redis | None = None) -> None:
    """Digests children recorded at first loads go into their ModelVersion rows; rows' digests Redis lost
    go back to Redis (the database keeps what later loads are verified against)."""
    client = client or get_redis()
    ensure_versions()  # a version first loaded before any row named it gets its row now
    recorded = client.hgetall(DIGESTS_KEY)
    for row in ModelVersion.objects.all():
        key = f"{row.model}@{row.version}"
        if not row.sha256 and key in recorded:
            ModelVersion.objects.filter(pk=row.pk, sha256="").update(sha256=recorded[key])
        elif row.sha256 and key not in recorded:
            client.hsetnx(DIGESTS_KEY, key, row.sha256)


def housekeeping() -> None:
    """The sampler tick's work for versions (registered in inference/apps.py)."""
    advance()


def version_listing(
    registry: Registry, workers: list[dict[str, Any]], *, staff: bool = False
) -> dict[str, dict[str, Any]]:
    """For /api/v1/models: each model's versions with status, and which are active, target and canary.
    A failed version's error (file paths, the loader's text) is shown to staff only, as other internals."""
    rows = {(v.model, v.version): v for v in ModelVersion.objects.all()}
    deployments = {row.model: as_state(row) for row in ModelDeployment.objects.all()}
    listing = {}
    for name in registry.names():
        state = deployments.get(name) or default_deployment(registry.models[name])
        loaded = loaded_versions(workers, name)
        versions = []
        for version in sorted(registry.versions_of(name)):
            row = rows.get((name, version))
            status = (
                row.status if row else (VersionStatus.ACTIVE if version == state.active else VersionStatus.AVAILABLE)
            )
            versions.append(
                {
                    "version": version,
                    "status": status,
                    "active": version == state.active,
                    "canary": version == state.canary,
                    "loaded_workers": len(loaded.by_version.get(version, ())),
                    **({"error": row.error} if staff and row and row.error else {}),
                }
            )
        listing[name] = {
            "active_version": state.active,
            "target_version": state.target,
            "previous_version": state.previous,
            "canary_version": state.canary,
            "canary_percent": state.canary_percent if state.canary else 0.0,
            "versions": versions,
        }
    return listing


def epoch(value: float) -> str:
    """An epoch as ISO 8601 (the API's deployment state)."""
    return datetime.fromtimestamp(value, tz=UTC).isoformat() if value else ""


def state_body(state: Deployment) -> dict[str, Any]:
    """A deployment as the staff API answers it."""
    return {
        "model": state.model,
        "active": state.active,
        "target": state.target,
        "previous": state.previous,
        "canary": state.canary,
        "canary_percent": state.canary_percent,
        "canary_ready": state.canary_ready,
        "changed_at": epoch(state.changed_at),
        "changed_by": state.changed_by,
    }
