"""Database calls from code that runs outside Django's request handler (the lean predict path)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import close_old_connections

T = TypeVar("T")


async def run_db(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run sync ORM work in a worker thread, closing stale connections before and after.

    Django's handler does that closing through the request_started / request_finished signals; a
    path that skips the handler must do it itself, or a connection broken by a database restart
    (or past CONN_MAX_AGE) would be kept for ever.
    """

    def call() -> T:
        close_old_connections()
        try:
            return fn(*args, **kwargs)
        finally:
            close_old_connections()

    # Not thread-sensitive: asgiref's one shared thread would queue every call of the process behind
    # the slowest (a slow-log insert waiting on an offline writer would hold up authentication).
    return await sync_to_async(call, thread_sensitive=False)()
