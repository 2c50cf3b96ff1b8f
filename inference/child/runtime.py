"""The models loaded in this worker child, and running a list of texts through one of them.

Loaded once per child in `worker_process_init` (inference/signals.py): never in the worker's
parent, whose CUDA context and OpenMP pools would not survive fork, and never in the web process.
Each child loads on its own device: a model's "cuda" becomes cuda:(pool index mod GPUs) in that child
(inference/core/gpu.py), and the heartbeat reports the devices loaded.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inference.child import cores
from inference.core import gpu
from inference.core.planning import plan_batches
from inference.core.registry import ModelSpec

if TYPE_CHECKING:
    from inference.child.handlers.base import Handler

logger = logging.getLogger(__name__)
# model -> the handler of the version this child runs when a caller names none (the deployment's active
# one when the child started; kept current by inference/child/versions.py).
_handlers: dict[str, Handler] = {}
# (model, version) -> handler: every version loaded here, the active one included (issue 21: a new
# version loads beside the one serving, and in-flight work of the old one finishes on it).
_versions: dict[tuple[str, str], Handler] = {}
# (model, version) -> when a pass last ran on it (monotonic): a version no longer wanted is unloaded
# only after a drain period without work.
_last_used: dict[tuple[str, str], float] = {}


class VersionNotLoaded(LookupError):
    """A request or job named a version this child has not loaded."""


@dataclass(frozen=True)
class Pass:
    """One forward pass a text ran in: wall-clock start and end (epoch seconds) and how many texts it held."""

    start: float
    end: float
    size: int


def load(specs: list[ModelSpec], threads: int | None = None) -> None:
    """Load, then warm up, every model this child serves (specs may hold several versions of a model).

    A version already here is kept as it is: a child forked from a worker that preloaded its models
    (`preload`) starts with them in memory and only loads what the deployment wants beyond them.
    """
    import torch

    from inference.child.handlers import build_handler

    threads = threads or max(spec.torch_threads for spec in specs)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    devices: list[str] = []
    defaults: set[str] = set()
    for spec in specs:
        handler = _versions.get((spec.name, spec.version))
        if handler is None or handler.spec != spec:
            handler = load_one(spec, build_handler)
        if spec.name not in defaults:  # the first spec given of a model is its default version
            _handlers[spec.name] = handler
            defaults.add(spec.name)
        devices.append(str(getattr(handler, "device", "cpu")))  # identity has no weights: it runs on the CPU
    gpu.set_loaded(devices)


def preloadable(specs: list[ModelSpec]) -> bool:
    """Whether these models may be loaded before the pool forks: CPU ones only (CUDA does not survive a
    fork; a GPU worker's children each load their own)."""
    return bool(specs) and all(str(spec.device).startswith("cpu") for spec in specs)


def load_one(spec: ModelSpec, build: Callable[[ModelSpec], Handler] | None = None) -> Handler:
    """Load and warm one version of a model and add it beside the others (serving goes on meanwhile when
    called from a background thread: the handler is published only once warm)."""
    if build is None:
        from inference.child.handlers import build_handler as build
    started = time.perf_counter()
    handler = build(spec)
    handler.warm_up()
    _versions[(spec.name, spec.version)] = handler
    logger.info(
        "loaded %s version %s (%s) on %s as %s in %.2f s",
        spec.name,
        spec.version,
        spec.task,
        getattr(handler, "device", "cpu"),
        spec.dtype or "float32",
        time.perf_counter() - started,
    )
    return handler


def unload_all() -> None:
    """Forget every loaded model (a failed preload: the children load their own)."""
    _versions.clear()
    _handlers.clear()
    _last_used.clear()


def unload(model: str, version: str) -> None:
    """Forget a version (its memory goes with the last pass still holding it)."""
    _versions.pop((model, version), None)
    _last_used.pop((model, version), None)
    logger.info("unloaded %s version %s", model, version)


def set_default(model: str, version: str) -> None:
    """The version run when a caller names none (the deployment's active one)."""
    if (model, version) in _versions:
        _handlers[model] = _versions[(model, version)]


def loaded_versions() -> dict[str, list[str]]:
    """model -> versions loaded here, for the heartbeat."""
    found: dict[str, list[str]] = {}
    for model, version in _versions:
        found.setdefault(model, []).append(version)
    return {model: sorted(versions) for model, versions in found.items()}


def last_used(model: str, version: str) -> float:
    return _last_used.get((model, version), 0.0)


def handler_for(model: str, version: str | None = None) -> Handler:
    """The handler of `model` at `version` (None: this child's default version of it)."""
    if version is None:
        return _handlers[model]
    handler = _versions.get((model, version))
    if handler is None:
        loaded = sorted(v for m, v in _versions if m == model)
        raise VersionNotLoaded(f"version {version!r} of model {model!r} is not loaded here (loaded: {loaded})")
    return handler


def loaded() -> list[str]:
    return sorted(_handlers)


def spec(model: str, version: str | None = None) -> ModelSpec:
    return handler_for(model, version).spec


def run(
    model: str,
    texts: list[Any],
    on_pass: Callable[[list[int], list[Any], list[Any]], None] | None = None,
    before_pass: Callable[[], int | None] | None = None,
    version: str | None = None,
) -> tuple[list[dict[str, Any]], list[Pass]]:
    """Outputs in input order, and for each input the forward pass it ran in.

    `texts` are the task's inputs: strings, or objects such as {"question", "context"} (task_io.py).

    `on_pass(indices, outputs, passes)` is called after each pass, so callers can answer early;
    `before_pass()` before each one, and may return the most texts the next pass may hold (the
    offline path waits there while online work runs, and keeps its passes short beside it).

    Texts are tokenized once, sorted by length and cut into passes by the model's padded-token
    budget: on a CPU a pass costs what its padded tokens cost, so similar lengths go together.

    `version` names the model's version (VersionNotLoaded when this child has not loaded it); None runs
    this child's default version of the model.
    """
    handler = handler_for(model, version)
    spec = handler.spec
    _last_used[(model, spec.version)] = time.monotonic()
    ids = handler.tokenize(texts)
    outputs: list[dict[str, Any] | None] = [None] * len(texts)
    passes: list[Pass | None] = [None] * len(texts)
    costs = [handler.cost(item) for item in ids]
    planned = deque(
        plan_batches(
            [longest for _, longest in costs],
            spec.max_batch_size,
            spec.max_batch_tokens,
            spec.max_padding_fraction,
            rows=[rows for rows, _ in costs],
        )
    )
    while planned:
        group = planned.popleft()
        limit = before_pass() if before_pass else None
        if limit and len(group) > limit:  # sorted by length, so each part is still of similar lengths
            planned.appendleft(group[limit:])
            group = group[:limit]
        start = time.time()
        with cores.around_pass(on_cpu=str(getattr(handler, "device", "cpu")).startswith("cpu")):
            results = handler.forward([ids[i] for i in group])
        if len(results) != len(group):
            raise RuntimeError(f"{model}: handler returned {len(results)} outputs for {len(group)} inputs")
        done = Pass(start, time.time(), len(group))
        for index, result in zip(group, results, strict=False):
            outputs[index] = result
            passes[index] = done
        if on_pass:
            on_pass(group, outputs, passes)
    _last_used[(model, spec.version)] = time.monotonic()
    return outputs, passes  # type: ignore[return-value]
