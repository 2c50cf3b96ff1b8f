"""Database helpers shared by the apps: calls from code that runs outside Django's request handler (the
lean predict path), and the per-user lock that makes a check of what a user has atomic with what it admits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model
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


def lock_user(user: Any) -> None:
    """Lock the user's row until the transaction ends: a check of what they have (jobs not yet ended,
    uploads being read, files kept, their current token) and the change it admits then happen as one,
    and their other requests doing the same wait their turn. Without it, requests sent at once all counted
    the same state and all passed."""
    list(get_user_model().objects.select_for_update().filter(pk=user.pk).values_list("pk", flat=True))
