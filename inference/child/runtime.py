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

from inference.core import gpu
from inference.core.planning import plan_batches
from inference.core.registry import ModelSpec

if TYPE_CHECKING:
    from inference.child.handlers.base import Handler

logger = logging.getLogger(__name__)
_handlers: dict[str, Handler] = {}


@dataclass(frozen=True)
class Pass:
    """One forward pass a text ran in: wall-clock start and end (epoch seconds) and how many texts it held."""

    start: float
    end: float
    size: int


def load(specs: list[ModelSpec]) -> None:
    """Load, then warm up, every model this child serves."""
    import torch

    from inference.child.handlers import build_handler

    threads = max(spec.torch_threads for spec in specs)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    devices: list[str] = []
    for spec in specs:
        started = time.perf_counter()
        handler = build_handler(spec)
        handler.warm_up()
        _handlers[spec.name] = handler
        device = str(getattr(handler, "device", "cpu"))  # the identity handler has no weights: it runs on the CPU
        logger.info(
            "loaded %s (%s) on %s as %s in %.2f s",
            spec.name,
            spec.task,
            device,
            spec.dtype or "float32",
            time.perf_counter() - started,
        )
        devices.append(device)
    gpu.set_loaded(devices)


def loaded() -> list[str]:
    return sorted(_handlers)


def spec(model: str) -> ModelSpec:
    return _handlers[model].spec


def run(
    model: str,
    texts: list[Any],
    on_pass: Callable[[list[int], list[Any], list[Any]], None] | None = None,
    before_pass: Callable[[], int | None] | None = None,
) -> tuple[list[dict[str, Any]], list[Pass]]:
    """Outputs in input order, and for each input the forward pass it ran in.

    `texts` are the task's inputs: strings, or objects such as {"question", "context"} (task_io.py).

    `on_pass(indices, outputs, passes)` is called after each pass, so callers can answer early;
    `before_pass()` before each one, and may return the most texts the next pass may hold (the
    offline path waits there while online work runs, and keeps its passes short beside it).

    Texts are tokenized once, sorted by length and cut into passes by the model's padded-token
    budget: on a CPU a pass costs what its padded tokens cost, so similar lengths go together.
    """
    handler = _handlers[model]
    spec = handler.spec
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
        results = handler.forward([ids[i] for i in group])
        if len(results) != len(group):
            raise RuntimeError(f"{model}: handler returned {len(results)} outputs for {len(group)} inputs")
        done = Pass(start, time.time(), len(group))
        for index, result in zip(group, results, strict=False):
            outputs[index] = result
            passes[index] = done
        if on_pass:
            on_pass(group, outputs, passes)
    return outputs, passes  # type: ignore[return-value]
