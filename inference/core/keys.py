"""Redis key names of the online path, in one place (the code and the tests import them from here).

The online queues themselves are Celery queues named in inference/core/queues.py (`online.<model>` or
the group the models file gives), whose Redis list is the queue's name.
"""

from __future__ import annotations

# Worker children's heartbeats: child id -> JSON (queue, models, state, resources, ts).
WORKERS_KEY = "inference:workers"
# Each worker's main process (the dispatcher: it consumes the queue and hands batches to children)
# beats here too. Children keep beating while their main process is stopped or wedged, so children
# alone would say "serving" while nothing is dispatched and every admitted request ends in 504.
DISPATCHERS_KEY = "inference:dispatchers"


def stats_key(model: str) -> str:
    """Lifetime counters of a model's online work (requests_done, expired_skipped, forward_passes...)."""
    return f"inference:stats:{model}"


def rate_key(model: str, second: int) -> str:
    """One second's drain-rate bucket of a model: done, tokens, busy child-seconds."""
    return f"inference:rate:{model}:{second}"


def last_rate_key(model: str) -> str:
    """Tokens per busy child-second last measured for `model`: the estimate after an idle spell."""
    return f"inference:rate:last-tokens:{model}"


def backlog_key(model: str) -> str:
    """Admitted requests (sorted set: request id scored by deadline)."""
    return f"inference:backlog:{model}"


def backlog_cost_key(model: str) -> str:
    """Each admitted request's cost and client (hash: request id -> "cost:client")."""
    return f"inference:backlog:{model}:cost"


def backlog_tokens_key(model: str) -> str:
    """Token totals of the backlog: "all", per client "c:<client>", requests per client "n:<client>"."""
    return f"inference:backlog:{model}:tokens"


def backlog_keys(model: str) -> list[str]:
    """The three keys every admission script takes, in their KEYS order: entries, costs, token totals."""
    return [backlog_key(model), backlog_cost_key(model), backlog_tokens_key(model)]


def reply_key(task_id: str) -> str:
    """The list a worker pushes the answer to a request that names no inbox (one published by hand)."""
    return f"inference:reply:{task_id}"


def inbox_key(owner: str) -> str:
    """The list a worker pushes the answers to one web process's requests to (inference/web/inbox.py)."""
    return f"inference:inbox:{owner}"
