"""Online queues: one per model, or per group of models that share a `queue:` in the models file.

A model's requests go to its own list in Redis (`online.<model>` by default), so a worker consumes
only the requests of the models it loads: a GPU host can be given one model, and a slow model's
backlog never sits in front of another model's requests. `-Q online` on a worker means "the online
queues of my models" (WORKER_MODELS, or every model); `-Q online.router` names one queue, and the
worker then loads the models of that queue. Either way the worker's queues and its models are
derived from each other here, in one place, so they cannot disagree.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kombu import Exchange, Queue

from inference.core.registry import Registry
from platform_.celery import OFFLINE_QUEUE, ONLINE_QUEUE, is_online_queue

logger = logging.getLogger(__name__)


def online_queues(registry: Registry) -> dict[str, list[str]]:
    """Each online queue and the models it carries, in the models file's order."""
    queues: dict[str, list[str]] = {}
    for name, spec in registry.models.items():
        queues.setdefault(spec.online_queue, []).append(name)
    return queues


def expand(consumed: Iterable[str], registry: Registry, worker_models: Iterable[str] = ()) -> list[str]:
    """The queues a worker consumes: `online` replaced by the online queues of `worker_models` (all
    models when empty); named queues are kept as they are."""
    chosen = set(worker_models) or set(registry.models)
    out: list[str] = []
    for name in consumed:
        if name == ONLINE_QUEUE:
            out += [q for q, models in online_queues(registry).items() if chosen & set(models)]
        else:
            out.append(name)
    return list(dict.fromkeys(out))


def served_models(consumed: Iterable[str], registry: Registry, worker_models: Iterable[str] = ()) -> list[str]:
    """The models a worker consuming `consumed` (already expanded) must load.

    Every model of each online queue it consumes: a request it takes from a queue is one it can
    answer. For the offline queue, WORKER_MODELS (or every model): jobs may name any of them.
    """
    consumed = list(consumed)
    by_queue = online_queues(registry)
    names: list[str] = []
    for queue in consumed:
        if queue in by_queue:
            names += by_queue[queue]
        elif is_online_queue(queue):
            logger.warning("queue %s carries no model of the models file: nothing will arrive there", queue)
    if OFFLINE_QUEUE in consumed:
        names += list(worker_models) or registry.names()
    return list(dict.fromkeys(names))


def apply_to_worker(app, registry: Registry, worker_models: Iterable[str] = ()) -> list[str]:
    """Rewrite the worker's selected queues (its `-Q`) into per-model online queues, consumed without
    acknowledgements (platform_/celery.py says why), before its consumer starts. Returns their names."""
    queues = app.amqp.queues
    selected = list(queues.consume_from or queues)  # no -Q: every declared queue
    names = expand(selected, registry, worker_models)
    for name in names:
        if is_online_queue(name):
            queues.add(online_queue(name))  # replaces the plain queue `-Q` created for the name
    queues.select(names)
    try:
        with app.connection_for_write() as connection:
            drop_offline_bindings(connection.default_channel)
    except Exception:  # the broker is away at start: the worker retries connecting, and the next start cleans
        logger.warning("could not check the offline exchange's bindings", exc_info=True)
    return names


def online_queue(name: str) -> Queue:
    """An online queue, bound to an exchange of its own.

    A queue declared without an exchange gets Celery's default one, which is the offline queue's, with
    its routing key: kombu's Redis transport then copies every message published to `offline` (each job
    chunk and upload) into that online list too, and online workers took offline work. Online messages
    are pushed onto their list directly (inference/web/publish.py), so the exchange only keeps them apart.
    """
    return Queue(name, Exchange(name, type="direct"), routing_key=name, no_ack=True)


def drop_offline_bindings(channel) -> int:
    """Remove online queues from the offline exchange's bindings, where workers of earlier releases
    declared them (the bindings live in Redis, so fixing the declaration alone would not undo them)."""
    client, removed = channel.client, 0
    for key in (channel.keyprefix_queue % OFFLINE_QUEUE, channel.keyprefix_binding_permanent % OFFLINE_QUEUE):
        stale = [m for m in client.smembers(key) if is_online_queue(_text(m).rsplit(channel.sep, 1)[-1])]
        if stale:
            removed += client.srem(key, *stale)
    return removed


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def predicted_wait_s(
    backlog_tokens: dict[str, float], rate_per_child: dict[str, float | None], children: int
) -> float | None:
    """How long a queue's admitted work takes its children to clear, in seconds: each model's backlog
    (tokens) over its measured rate (tokens per busy child-second), shared by the queue's children.

    The quantity to scale a queue on: depth alone means nothing without the rate it drains at, and a
    request is late when this passes its deadline. None while a model with work has no measured rate;
    infinite when there is work and no child to do it.
    """
    work_s = 0.0
    for model, tokens in backlog_tokens.items():
        if tokens <= 0:
            continue
        rate = rate_per_child.get(model)
        if not rate:
            return None
        work_s += tokens / rate
    if work_s == 0:
        return 0.0
    return work_s / children if children > 0 else float("inf")
