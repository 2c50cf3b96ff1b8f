"""The model's own ceiling, in this process: no HTTP, no queue, no other process.

Single-request latency, throughput at each batch size in arrival order, and in length-sorted passes
cut exactly as the workers cut them (inference.batching.plan_batches), with one torch thread per
process as the workers run: the figures the platform is measured against.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass


@dataclass
class Ceiling:
    single_p50_ms: float
    single_mean_ms: float
    per_batch_size: dict[int, tuple[float, float]]  # batch size -> (arrival order texts/s, length-sorted texts/s)

    def best(self, sorted_: bool) -> tuple[int, float]:
        index = 1 if sorted_ else 0
        size = max(self.per_batch_size, key=lambda b: self.per_batch_size[b][index])
        return size, self.per_batch_size[size][index]


def load_handler(model: str, threads: int = 1):
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import django

    django.setup()
    import torch

    from inference.handlers import build_handler
    from inference.registry import get_registry

    torch.set_num_threads(threads)
    handler = build_handler(get_registry().get(model))
    handler.warm_up()
    return handler


def sorted_passes_rate(handler, texts: list[str], dispatch: int, max_batch_size: int | None = None) -> float:
    """Texts/s when `dispatch` texts at a time are cut into length-sorted passes, as a worker child does."""
    from inference.batching import plan_batches

    spec = handler.spec
    size = max_batch_size or spec.max_batch_size
    started = time.perf_counter()
    for start in range(0, len(texts), dispatch):
        ids = handler.tokenize(texts[start : start + dispatch])
        for group in plan_batches([len(r) for r in ids], size, spec.max_batch_tokens, spec.max_padding_fraction):
            handler.forward([ids[i] for i in group])
    return len(texts) / (time.perf_counter() - started)


def measure(model: str, texts: list[str], batch_sizes=(1, 2, 4, 8, 16, 32)) -> Ceiling:
    handler = load_handler(model)
    single = []
    for text in texts[:200]:
        started = time.perf_counter()
        handler.predict([text])
        single.append(time.perf_counter() - started)
    per_size = {}
    for size in batch_sizes:
        started = time.perf_counter()
        for start in range(0, len(texts), size):
            handler.predict(texts[start : start + size])
        arrival = len(texts) / (time.perf_counter() - started)
        # Sorted within a dispatch of 4 batches' worth: what accumulates while children are busy.
        per_size[size] = (arrival, sorted_passes_rate(handler, texts, dispatch=max(size * 4, 8), max_batch_size=size))
    return Ceiling(statistics.median(single) * 1000, statistics.mean(single) * 1000, per_size)
