"""The Celery app: online queues (one per model or model group) and the offline queue; JSON only."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import celery.app.utils as celery_app_utils
from celery import Celery
from kombu import Exchange, Queue

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings.local")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Weight-loading progress bars are noise in worker logs.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

app = Celery("platform_")
app.config_from_object("django.conf:settings", namespace="CELERY")

# `online` is not a list anything is published to: on a worker's -Q it stands for the online queues
# of the worker's models, `online.<model>` (inference/core/queues.py rewrites it before consuming starts).
ONLINE_QUEUE = "online"
ONLINE_QUEUE_PREFIX = f"{ONLINE_QUEUE}."
OFFLINE_QUEUE = "offline"

app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    # The online queue is consumed without acknowledgements: a request carries a deadline and its
    # caller is answered (504) when it is lost, so at-most-once delivery is right there, and it saves
    # the worker two Redis transactions per message (kombu's unacked bookkeeping and the ack; ~60% of
    # the online worker's main-process CPU, docs/benchmarks.md). Offline chunks keep acks_late.
    # Online messages are never published through Celery: the web tier's admission script pushes them
    # onto their model's queue (inference/web/publish.py), so no route names them here.
    # Each queue has its own exchange: a queue given none shares the default (offline) one, and kombu's
    # Redis transport would copy every offline message into it (inference/core/queues.py, online_queue).
    task_queues=(
        Queue(ONLINE_QUEUE, Exchange(ONLINE_QUEUE, type="direct"), routing_key=ONLINE_QUEUE, no_ack=True),
        Queue(OFFLINE_QUEUE, Exchange(OFFLINE_QUEUE, type="direct"), routing_key=OFFLINE_QUEUE),
    ),
    task_default_queue=OFFLINE_QUEUE,
    task_routes={"jobs.*": {"queue": OFFLINE_QUEUE}},
    # Online work is never retried by redelivery: its caller has a deadline and gets 504 instead.
    task_acks_late=False,
    worker_send_task_events=True,
    task_send_sent_event=False,
    broker_connection_retry_on_startup=True,
)
app.autodiscover_tasks(["inference", "jobs"])


def is_online_queue(name: str) -> bool:
    return name == ONLINE_QUEUE or name.startswith(ONLINE_QUEUE_PREFIX)


def worker_role() -> str:
    """`online` or `offline`: what this worker process consumes (its `-Q`), so a worker's identity (its
    heartbeats, admission's view of who serves a model, the offline worker's reconciler and priority)
    cannot disagree with its queues. Outside a worker, or one consuming every queue, WORKER_QUEUE says."""
    consumed = set(app.amqp.queues.consume_from or ())
    online = any(is_online_queue(q) for q in consumed)
    if consumed and not online and OFFLINE_QUEUE in consumed:
        return "offline"
    if online and OFFLINE_QUEUE not in consumed:
        return "online"
    return os.environ.get("WORKER_QUEUE", "online")


# Censoring of the app's configuration wherever Celery shows it: a worker's answer to `inspect conf`
# (Flower's Config tab of a worker), `celery report` and `inspect report`. The configuration is every
# Django setting (config_from_object above), and Celery masks a setting only when its name says
# API, TOKEN, KEY, SECRET, PASS or DATABASE, or for the broker and result backend URLs: REDIS_URL and
# CACHES' LOCATION showed their password to anyone who could open Flower.
SETTING_MASK = "********"
# A password in a URL: scheme://user:password@ (user may be empty, as in redis://:password@host). The
# password stops at the first @ (a literal @ in one must be %-encoded to parse at all); over-masking an
# odd value is harmless.
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^:/?#@\s]*:)[^@\s]+(?=@)")
# Names Celery's list misses that hold a credential whole (a Sentry DSN carries its key).
_MORE_HIDDEN_NAMES = re.compile(r"CREDENTIAL|PRIVATE|DSN", re.IGNORECASE)
_celery_censored = celery_app_utils.filter_hidden_settings


def _without_url_passwords(value: Any) -> Any:
    if isinstance(value, str):
        return _URL_PASSWORD.sub(rf"\g<head>{SETTING_MASK}", value)
    if isinstance(value, Mapping):
        return {key: _without_url_passwords(item) for key, item in value.items()}
    if type(value) in (list, tuple, set, frozenset):  # plain containers only: a namedtuple keeps its shape
        return type(value)(_without_url_passwords(item) for item in value)
    return value


def censored_settings(conf: Mapping[str, Any]) -> dict[str, Any]:
    """Celery's censoring (by setting name, nested settings included), then the credential-holding names
    it misses masked whole and the password of every URL, in any value at any depth, masked."""
    return {
        key: SETTING_MASK if isinstance(key, str) and _MORE_HIDDEN_NAMES.search(key) else _without_url_passwords(value)
        for key, value in _celery_censored(conf).items()
    }


# Celery's Settings.table() and humanize() (behind `inspect conf` and every report) call this module-level
# function, and nested mappings come back through it too; Celery offers no other hook.
celery_app_utils.filter_hidden_settings = censored_settings
