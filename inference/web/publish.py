"""The Celery message of an online request, built by the async web tier without kombu.

`apply_async` is a synchronous kombu publish: called from the async predict view it stalls the
event loop (every waiting request of the process) for its round trip, and for kombu's retries when
the broker is slow, and its errors are kombu's, not Redis's. Here the same Celery protocol-2 message
that `apply_async` builds for `inference.predict_online` is built as bytes, and the admission script
LPUSHes it onto the list kombu's Redis transport consumes (priority 0 lives under the queue's own
name) in the round trip that admits it (inference/web/admission.py). A broker fault is a
`redis.RedisError` the view answers with 503, and the publish costs a fraction of the CPU
(shared/measurements.md: ~70 µs against ~600 µs for the LPUSH alone). The envelope is checked against
kombu's in tests/inference/test_publish.py.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import uuid
from typing import Any

TASK_NAME = "inference.predict_online"
_ORIGIN = f"{os.getpid()}@{socket.gethostname()}"
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def task_message(task_id: str, queue: str, kwargs: dict[str, Any]) -> bytes:
    """The kombu Redis envelope of a Celery protocol-2 message calling TASK_NAME with `kwargs`."""
    body = json.dumps([[], kwargs, _EMBED], separators=(",", ":")).encode()
    envelope = {
        "body": base64.b64encode(body).decode("ascii"),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {
            "lang": "py",
            "task": TASK_NAME,
            "id": task_id,
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": task_id,
            "parent_id": None,
            "argsrepr": "()",
            # Not the texts: they are the client's data, and would double the message (Flower shows this).
            "kwargsrepr": f"{{'model': {kwargs['model']!r}, 'texts': {len(kwargs['inputs'])}}}",
            "origin": _ORIGIN,
            "ignore_result": True,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
        },
        "properties": {
            "correlation_id": task_id,
            "reply_to": "",
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": uuid.uuid4().hex,
        },
    }
    return json.dumps(envelope, separators=(",", ":")).encode()
