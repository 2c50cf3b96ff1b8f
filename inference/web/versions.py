"""Which model version an online request goes to, decided in the web tier and stamped on the request.

The choice is made here, once, so a request keeps its version wherever it is queued: a swap that
happens while it waits does not change what answers it (the child runs the stamped version, which
stays loaded until it has drained). A caller either pins a version (`model@version`, accepted only
where every live online child of the model has it loaded, since any of them may take the request) or
gets the deployment's choice: the active version, or the canary for a sticky share of callers.

The deployment mirror is read at most every INFERENCE_DEPLOYMENT_CACHE_MS per process: a read that
much stale still names a loaded version (a replaced one drains for INFERENCE_VERSION_DRAIN_S).
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings

from inference.core.keys import DISPATCHERS_KEY, WORKERS_KEY
from inference.core.registry import ModelSpec, get_registry
from inference.core.versions import DEPLOYMENTS_KEY, Deployment, choose_version, deployments_from, loaded_versions
from inference.core.workers import serving_workers
from platform_.errors import ApiError
from platform_.redis import get_async_redis

_deployments: tuple[float, dict[str, Deployment]] = (0.0, {})
_workers: tuple[float, list[dict[str, Any]]] = (0.0, [])
# Heartbeats are read for pins only, and change at heartbeat pace: a second's reuse is plenty fresh.
_WORKERS_CACHE_S = 1.0


async def deployment(model: str) -> Deployment:
    """The model's deployment, from this process's recent read of the mirror."""
    global _deployments
    read_at, found = _deployments
    if time.monotonic() - read_at > settings.INFERENCE_DEPLOYMENT_CACHE_MS / 1000 or model not in found:
        raw = await get_async_redis().hgetall(DEPLOYMENTS_KEY)
        found = deployments_from(raw, get_registry())
        _deployments = (time.monotonic(), found)
    return found[model]


async def choose(spec: ModelSpec, caller: str) -> str:
    """The version a caller's request to `spec` goes to (active, or the canary for its sticky share)."""
    return choose_version(await deployment(spec.name), caller)


async def _live_workers() -> list[dict[str, Any]]:
    global _workers
    read_at, workers = _workers
    if time.monotonic() - read_at > _WORKERS_CACHE_S:
        client = get_async_redis()
        workers = serving_workers(
            await client.hgetall(WORKERS_KEY),
            await client.hgetall(DISPATCHERS_KEY),
            settings.WORKER_HEARTBEAT_S,
            settings.DISPATCHER_HEARTBEAT_S,
        )
        _workers = (time.monotonic(), workers)
    return workers


async def check_pin(spec: ModelSpec, version: str) -> str:
    """`version` when a request may pin it: 404 when the models file does not name it, 409 when not every
    live online child of the model has it loaded (the message names the versions that are)."""
    known = get_registry().versions_of(spec.name)
    if version not in known:
        raise ApiError(
            404,
            "unknown_version",
            f"model {spec.name!r} has no version {version[:40]!r}; its versions: {', '.join(sorted(known))}",
        )
    loaded = loaded_versions(await _live_workers(), spec.name).loaded_online()
    if version not in loaded:
        raise ApiError(
            409,
            "version_not_loaded",
            f"version {version!r} of model {spec.name!r} is not loaded by the online workers; loaded: "
            f"{', '.join(loaded) or 'none'} (promote it or set it as a canary to load it)",
            loaded_versions=loaded,
        )
    return version


def forget() -> None:
    """Drop this process's cached reads (tests)."""
    global _deployments, _workers
    _deployments, _workers = (0.0, {}), (0.0, [])
