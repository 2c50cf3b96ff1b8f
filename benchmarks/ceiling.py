"""The model's own ceiling, in this process: no HTTP, no queue, no other process.

Single-request latency, throughput at each batch size in arrival order, and in length-sorted passes
cut exactly as the workers cut them (inference.dispatch.batching.plan_batches), with one torch thread per
process as the workers run: the figures the platform is measured against.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class Ceiling:
    single_p50_ms: float
    single_mean_ms: float
    single_p99_ms: float  # the corpus's own spread: P99/P50 here is the floor for any server's P99/P50
    per_batch_size: dict[int, tuple[float, float]]  # batch size -> (arrival order texts/s, length-sorted texts/s)
    # Length-sorted texts/s of N processes running at once (N -> texts/s): the ceiling of N worker children.
    parallel: dict[int, float] = field(default_factory=dict)

    def best(self, sorted_: bool) -> tuple[int, float]:
        index = 1 if sorted_ else 0
        size = max(self.per_batch_size, key=lambda b: self.per_batch_size[b][index])
        return size, self.per_batch_size[size][index]


def load_handler(model: str, threads: int = 1):
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings.local")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import django

    django.setup()
    import torch

    from inference.child.handlers import build_handler
    from inference.core.registry import get_registry

    torch.set_num_threads(threads)
    handler = build_handler(get_registry().get(model))
    handler.warm_up()
    return handler


def sorted_passes_rate(handler, texts: list[str], dispatch: int, max_batch_size: int | None = None) -> float:
    """Texts/s when `dispatch` texts at a time are cut into length-sorted passes, as a worker child does."""
    from inference.core.planning import plan_batches

    spec = handler.spec
    size = max_batch_size or spec.max_batch_size
    started = time.perf_counter()
    for start in range(0, len(texts), dispatch):
        ids = handler.tokenize(texts[start : start + dispatch])
        for group in plan_batches([len(r) for r in ids], size, spec.max_batch_tokens, spec.max_padding_fraction):
            handler.forward([ids[i] for i in group])
    return len(texts) / (time.perf_counter() - started)


def measure(model: str, texts: list[str], batch_sizes=(1, 2, 4, 8, 16, 32), processes: int = 1) -> Ceiling:
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
    single.sort()
    ceiling = Ceiling(
        statistics.median(single) * 1000,
        statistics.mean(single) * 1000,
        single[min(len(single) - 1, round(0.99 * (len(single) - 1)))] * 1000,
        per_size,
    )
    if processes > 1:
        best_size, _ = ceiling.best(sorted_=True)
        ceiling.parallel[processes] = parallel_sorted_rate(model, texts, processes, best_size)
    return ceiling


def _parallel_worker(model: str, texts: list[str], batch_size: int, dispatch: int, ready, go, results) -> None:
    handler = load_handler(model)
    sorted_passes_rate(handler, texts[:64], dispatch=dispatch, max_batch_size=batch_size)  # warm
    ready.wait()
    go.wait()
    results.put(sorted_passes_rate(handler, texts, dispatch=dispatch, max_batch_size=batch_size))


def parallel_sorted_rate(
    model: str, texts: list[str], processes: int, batch_size: int, dispatch: int | None = None
) -> float:
    """Texts/s of `processes` fresh processes (one torch thread each) running length-sorted passes at once,
    each taking `dispatch` texts at a time (default: four batches' worth) and cutting them into passes.

    Twice one process's rate would overstate two children on two cores: they share caches and
    memory bandwidth. Spawned, not forked: torch's thread pools do not survive fork.
    """
    dispatch = dispatch or batch_size * 4
    ctx = multiprocessing.get_context("spawn")
    ready, go, results = ctx.Barrier(processes + 1), ctx.Barrier(processes + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_parallel_worker, args=(model, texts, batch_size, dispatch, ready, go, results))
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        ready.wait(timeout=600)  # a process that died loading breaks the barrier instead of hanging
        go.wait(timeout=60)
        return sum(results.get(timeout=600) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
