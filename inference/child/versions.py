"""A worker child's model versions: which it keeps loaded, checked and warm, and when it lets one go.

A background thread (the keeper) reads the deployment mirror (inference/core/versions.py) every
INFERENCE_VERSION_POLL_S and loads every version a served model wants (active, target, canary) beside
the ones serving, so serving never stops for a load. The heartbeat reports what is loaded; the switch
to a target waits until every live online child reports it (inference/deployments.py). A version no
longer wanted stays for INFERENCE_VERSION_DRAIN_S (just over the longest online deadline) after the
child saw it replaced (offline: after its last job pass): requests the web tier stamped with it before
the switch still find it here.

Every load is verified first: the version folder's checksum against the models file's `sha256:`, or,
without one, against the digest the first load of that version anywhere recorded. A mismatch refuses
that version (logged, and reported in the heartbeat for the deployment to mark it failed); what
serves is untouched.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import redis

from inference.child import runtime
from inference.core.registry import ModelSpec, Registry
from inference.core.versions import DEPLOYMENTS_KEY, DIGESTS_KEY, Deployment, cached_checksum, deployments_from
from inference.core.workers import WorkerState

logger = logging.getLogger(__name__)


class VersionRefused(RuntimeError):
    """A version's files do not match its checksum (or fail to load): it is not served here."""


def verify(spec: ModelSpec, client: redis.Redis | None) -> str:
    """The version's checksum, checked against the declared or first recorded one (VersionRefused if not)."""
    digest = cached_checksum(spec)
    expected = spec.sha256
    if not expected and client is not None:
        key = f"{spec.name}@{spec.version}"
        client.hsetnx(DIGESTS_KEY, key, digest)  # the first load anywhere records it; later ones compare
        expected = client.hget(DIGESTS_KEY, key)
    if expected and digest != expected.lower():
        raise VersionRefused(
            f"checksum mismatch for {spec.name}@{spec.version}: its files hash to {digest[:12]}..., "
            f"expected {expected[:12]}...; the version is not loaded"
        )
    return digest


def read_deployments(client: redis.Redis, registry: Registry) -> dict[str, Deployment]:
    return deployments_from(client.hgetall(DEPLOYMENTS_KEY), registry)


def initial_specs(
    client: redis.Redis, registry: Registry, models: list[str], errors: dict[str, dict]
) -> list[ModelSpec]:
    """What a child loads before it announces itself: every wanted version of its models, active first.

    A wanted version other than the active one that fails verification is left out (and reported); the
    active one failing fails the child, as a missing folder does.
    """
    try:
        deployments = read_deployments(client, registry)
    except redis.RedisError:
        logger.warning("the deployment mirror is unreadable; loading the models file's versions", exc_info=True)
        deployments = deployments_from({}, registry)
    specs = []
    for model in models:
        deployment = deployments[model]
        for version in [deployment.active, *sorted(deployment.wanted() - {deployment.active})]:
            spec = registry.version_spec(model, version)
            if spec is None:
                continue
            try:
                verify(spec, client)
            except VersionRefused as refused:
                if version == deployment.active:
                    raise
                logger.error("%s", refused)
                errors[f"{model}@{version}"] = {"error": str(refused), "changed_at": deployment.changed_at}
                continue
            specs.append(spec)
    return specs


class VersionKeeper:
    """Keeps each served model's wanted versions loaded in this child; start() and stop() bound its life."""

    def __init__(
        self,
        client: redis.Redis,
        registry: Registry,
        models: list[str],
        state: WorkerState,
        publish: Callable[[], None],
        *,
        poll_s: float,
        drain_s: float,
        max_on_demand: int = 2,
        load_nice: int = 0,
    ) -> None:
        self.client, self.registry, self.models, self.state = client, registry, models, state
        self.publish_beat = publish
        self.poll_s, self.drain_s, self.max_on_demand = poll_s, drain_s, max_on_demand
        self.load_nice = load_nice
        self.errors: dict[str, dict] = dict(state.version_errors)
        self._seen_change: dict[str, float] = {}
        self._unwanted_since: dict[tuple[str, str], float] = {}
        self._wanted: dict[str, set[str]] = {}
        self._load_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="version-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        # Linux sets a niceness per thread: the loads run at a lower CPU priority than the serving thread.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.load_nice)
        except (AttributeError, OSError):
            pass  # not Linux, or not allowed: loads share the cores evenly
        while not self._stop.wait(self.poll_s):
            try:
                self.step()
            except redis.RedisError:
                pass  # the mirror is away for a moment: what is loaded keeps serving
            except Exception:
                logger.exception("the version keeper's step failed; it tries again in %.1f s", self.poll_s)

    def step(self, now: float | None = None) -> None:
        """Load what is wanted and missing, let go what has drained, and say so in the heartbeat."""
        deployments = read_deployments(self.client, self.registry)
        changed = False
        for model in self.models:
            deployment = deployments[model]
            if self._seen_change.get(model) != deployment.changed_at:
                # A new promote or canary: versions refused for an earlier one may be retried (their files
                # may have been fixed since).
                self._seen_change[model] = deployment.changed_at
                changed |= self._forget_errors(model)
            wanted = deployment.wanted()
            self._wanted[model] = wanted
            for version in sorted(wanted):
                if (model, version) not in runtime._versions and f"{model}@{version}" not in self.errors:
                    changed |= self._load(model, version, deployment)
            runtime.set_default(model, deployment.active)
            changed |= self._unload_drained(model, wanted, time.monotonic() if now is None else now)
            if self.state.versions_seen.get(model) != deployment.changed_at:
                self.state.versions_seen[model] = deployment.changed_at  # what `versions` now answers
                changed = True
        if changed:
            self.publish()

    def ensure(self, model: str, version: str) -> None:
        """Load `version` now if this child lacks it (an offline job pinned to it), keeping at most
        max_on_demand versions beyond the wanted ones: the least recently used other goes first."""
        if (model, version) in runtime._versions:
            return
        spec = self.registry.version_spec(model, version)
        if spec is None:
            raise VersionRefused(f"model {model!r} has no version {version!r} in the models file")
        with self._load_lock:
            if (model, version) not in runtime._versions:
                verify(spec, self.client)
                runtime.load_one(spec)
        wanted = self._wanted.get(model, set())
        extra = [v for (m, v) in list(runtime._versions) if m == model and v not in wanted and v != version]
        extra.sort(key=lambda v: runtime.last_used(model, v))
        while len(extra) + 1 > self.max_on_demand:
            runtime.unload(model, extra.pop(0))
        self.publish()

    def publish(self) -> None:
        self.state.versions = runtime.loaded_versions()
        self.state.version_errors = dict(self.errors)
        try:
            self.publish_beat()
        except redis.RedisError:
            pass  # the next regular beat carries it

    def _forget_errors(self, model: str) -> bool:
        stale = [key for key in self.errors if key.startswith(f"{model}@")]
        for key in stale:
            del self.errors[key]
        return bool(stale)

    def _load(self, model: str, version: str, deployment: Deployment) -> bool:
        spec = self.registry.version_spec(model, version)
        if spec is None:
            return False  # the mirror names a version this child's models file lacks: nothing to load
        try:
            with self._load_lock:
                verify(spec, self.client)
                runtime.load_one(spec)
        except redis.RedisError:
            raise
        except Exception as exc:
            reason = str(exc) if isinstance(exc, VersionRefused) else f"loading {model}@{version} failed: {exc}"
            logger.error("%s", reason, exc_info=not isinstance(exc, VersionRefused))
            self.errors[f"{model}@{version}"] = {"error": reason[:500], "changed_at": deployment.changed_at}
            return True
        return True

    def _unload_drained(self, model: str, wanted: set[str], now: float) -> bool:
        changed = False
        for m, version in list(runtime._versions):
            if m != model:
                continue
            key = (model, version)
            if version in wanted:
                self._unwanted_since.pop(key, None)
                continue
            since = self._unwanted_since.setdefault(key, now)
            # Online: drained from when this child saw it unwanted. Nothing unpinned is stamped with it
            # after the switch, and whatever was is past its deadline within drain_s, so work counted
            # from then would only let a tenant pinning a replaced version keep it loaded for good.
            # Offline: a job pinned to it is still running on it; counting from its last pass keeps the
            # child from reloading it every drain period.
            if self.state.queue != "online":
                since = max(since, runtime.last_used(model, version))
            if now - since >= self.drain_s:
                runtime.unload(model, version)
                self._unwanted_since.pop(key, None)
                changed = True
        return changed


keeper: VersionKeeper | None = None  # this child's, started by inference/child/worker_process.py
