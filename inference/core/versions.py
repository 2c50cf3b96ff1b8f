"""Model versions as every process sees them: checksums, the deployment mirror in Redis, and the choice of a
version for a request (issue 21).

The database's ModelDeployment rows are the record of truth (inference/deployments.py writes them); the
Redis hash here mirrors them so that the web tier (on every request) and worker children (twice a second)
read one hash instead of the database. Losing the hash loses nothing: the housekeeping tick writes it
again from the rows, and until then every reader falls back to the models file's entry version.

Torch-free and Django-free but for settings: the web tier, worker children and `manage.py` import it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from inference.core.registry import ModelSpec, Registry

# model -> JSON of its Deployment (the mirror of its ModelDeployment row).
DEPLOYMENTS_KEY = "inference:deployments"
# "model@version" -> sha256 a child recorded at the first load of a version without a declared one.
DIGESTS_KEY = "inference:version-digests"
# Sticky canary buckets: a caller's share of a model falls in 0..BUCKETS-1; percent*100 of them are the canary's.
BUCKETS = 10_000
_READ_BYTES = 1 << 20


@dataclass(frozen=True)
class Deployment:
    """Which versions of a model serve: `active` takes the traffic, `target` is being loaded to replace it,
    `canary` takes `canary_percent` of the callers once `canary_ready` (every child loaded it)."""

    model: str
    active: str
    target: str | None = None
    previous: str | None = None
    canary: str | None = None
    canary_percent: float = 0.0
    canary_ready: bool = False
    changed_at: float = 0.0
    changed_by: str = ""

    def wanted(self) -> set[str]:
        """The versions a child serving this model keeps loaded: active, and target and canary beside it."""
        return {v for v in (self.active, self.target, self.canary) if v}

    def as_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str) -> Deployment:
        values = json.loads(raw)
        return cls(**{k: v for k, v in values.items() if k in cls.__dataclass_fields__})


def default_deployment(spec: ModelSpec) -> Deployment:
    """With no row: the models file's entry version serves alone."""
    return Deployment(model=spec.name, active=spec.version)


def deployments_from(raw: dict[str, str], registry: Registry) -> dict[str, Deployment]:
    """Every model's deployment from the mirror's hash, the file's default where the hash has none (or a
    version the file no longer names: the file wins over a stale mirror)."""
    found: dict[str, Deployment] = {}
    for name, spec in registry.models.items():
        deployment = default_deployment(spec)
        if name in raw:
            try:
                mirrored = Deployment.from_json(raw[name])
            except (ValueError, TypeError):
                mirrored = deployment
            known = registry.versions_of(name)
            if mirrored.active in known:
                deployment = mirrored
        found[name] = deployment
    return found


def choose_version(deployment: Deployment, caller: str) -> str:
    """The version a caller's request goes to: the canary for a sticky `canary_percent` of callers, once
    ready, else the active one.

    The bucket is a hash of (caller, model), not a random draw, so one user always sees one version of a
    model (their answers do not flip between versions from one call to the next), and different models'
    canaries take different users.
    """
    if deployment.canary and deployment.canary_ready and deployment.canary_percent > 0:
        if sticky_bucket(caller, deployment.model) < deployment.canary_percent * BUCKETS / 100:
            return deployment.canary
    return deployment.active


def sticky_bucket(caller: str, model: str) -> int:
    digest = hashlib.sha256(f"{caller}\0{model}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def split_pin(name: str) -> tuple[str, str | None]:
    """`router@2` -> ("router", "2"); `router` -> ("router", None)."""
    model, at, version = name.partition("@")
    return model, (version if at else None)


def checksum(folder: Path) -> str:
    """sha256 over a version's folder: each file's path relative to it and its contents, in sorted order,
    so a renamed, added, removed or changed file changes it (and a copied folder keeps it)."""
    folder = Path(folder)
    if folder.is_file():
        files = [folder]
        folder = folder.parent
    else:
        files = sorted((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.relative_to(folder).as_posix())
    digest = hashlib.sha256()
    for path in files:
        name = path.relative_to(folder).as_posix().encode()
        digest.update(len(name).to_bytes(8, "big") + name)
        digest.update(path.stat().st_size.to_bytes(8, "big"))
        with open(path, "rb") as handle:
            while chunk := handle.read(_READ_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def version_checksum(spec: ModelSpec) -> str:
    """The checksum a version is verified by: its folder's, and its routes file's when it has one (a
    router's version may differ from another only by its routes)."""
    digest = checksum(spec.resolved_path())
    routes = spec.resolved_routes()
    if routes is None:
        return digest
    return hashlib.sha256(f"{digest}:{checksum(routes)}".encode()).hexdigest()


_checksums: dict[tuple[str, str | None, int], str] = {}


def cached_checksum(spec: ModelSpec) -> str:
    """version_checksum, once per folder and its newest change in this process (four models served from
    one package's folder read it once)."""
    path = spec.resolved_path()
    key = (str(path), spec.routes, _newest_change_ns(path))
    if key not in _checksums:
        _checksums[key] = version_checksum(spec)
    return _checksums[key]


def _newest_change_ns(path: Path) -> int:
    if path.is_file():
        return path.stat().st_mtime_ns
    return max((os.stat(p).st_mtime_ns for p in path.rglob("*")), default=0)


@dataclass
class LoadedVersions:
    """What live children report of one model: per version, the children that have it loaded, and the
    children serving the model at all."""

    children: set[str] = field(default_factory=set)
    online_children: set[str] = field(default_factory=set)
    by_version: dict[str, set[str]] = field(default_factory=dict)
    # version -> {"error", "changed_at"} (the deployment change the refusal answered)
    errors: dict[str, dict[str, Any]] = field(default_factory=dict)

    def on_all(self, version: str, *, online_only: bool = False) -> bool:
        """Whether every such child (at least one) has `version` loaded."""
        children = self.online_children if online_only else self.children
        return bool(children) and children <= self.by_version.get(version, set())

    def ready_for(self, version: str) -> bool:
        """Whether a switch to `version` (or a canary of it) may happen: every live online child of the model
        has it loaded; with no online child, every live child (an offline-only model).

        Offline children load wanted versions too, but need not hold up a switch: no online request
        reaches them, and a job runs on its pinned version, which its child loads when it lacks it. A
        busy offline child (it runs at a low CPU priority) took minutes to load a version beside a
        running job in the live test, where the online children took under one.
        """
        return self.on_all(version, online_only=bool(self.online_children))

    def loaded_online(self) -> list[str]:
        """Versions every live online child has loaded, which a pinned request may name."""
        return sorted(v for v in self.by_version if self.on_all(v, online_only=True))


def loaded_versions(workers: list[dict[str, Any]], model: str, since: float | None = None) -> LoadedVersions:
    """From live children's heartbeats (inference/core/workers.py: `versions`, `version_errors`).

    `since`: a deployment change (changed_at). A child whose keeper has not yet acted on it counts as
    holding no version: what it reported may be from before (it may have unloaded since), and a switch
    made on it sent a rollback's requests to children without the version (the live test, 1,486 x 409).
    """
    found = LoadedVersions()
    for worker in workers:
        if model not in worker.get("models", ()):
            continue
        wid = worker.get("worker_id", "")
        found.children.add(wid)
        if worker.get("queue") == "online":
            found.online_children.add(wid)
        if since is not None and (worker.get("versions_seen") or {}).get(model, 0.0) < since:
            continue
        for version in (worker.get("versions") or {}).get(model, ()):
            found.by_version.setdefault(version, set()).add(wid)
        for key, error in (worker.get("version_errors") or {}).items():
            name, version = split_pin(key)
            if name == model and version:
                found.errors[version] = error
    return found
