"""The web process keeps no database connection after a request: under ASGI each request's sync work
runs on a thread of its own, and a persistent connection would stay open after it (a burst of one
tenant's requests could hold every connection PostgreSQL allows, and every other client gets 500s)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import wait_until

pytestmark = pytest.mark.integration


def _connections(django_db_blocker) -> int:
    from django.db import connection

    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return cursor.fetchone()[0]


def test_a_burst_of_requests_leaves_no_connection_held(stack, django_db_blocker):
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("connections are counted in PostgreSQL's pg_stat_activity (set DATABASE_URL)")
    before = _connections(django_db_blocker)

    def list_jobs(_):
        return requests.get(f"{stack.url}/api/v1/jobs", headers=stack.headers(), timeout=60).status_code

    with ThreadPoolExecutor(10) as pool:
        assert set(pool.map(list_jobs, range(40))) == {200}
    # Workers may open a connection meanwhile (a reconciler tick): a small margin, not 10 per burst.
    wait_until(lambda: _connections(django_db_blocker) <= before + 2, 15, "the web's connections to close")
