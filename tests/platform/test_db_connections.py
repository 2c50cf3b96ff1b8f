"""The web process holds at most its pool of database connections, however many requests it serves at
once: under ASGI each request's sync work runs on a thread of its own, and with a connection per request
(or a persistent one per thread) a burst of one tenant's requests could hold every connection PostgreSQL
allows, and every other client gets errors. platform_/asgi.py: WEB_DB_POOL_SIZE (8 on the test stack)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

pytestmark = pytest.mark.integration


def _web_connections(django_db_blocker, web_pid: int) -> int:
    from django.db import connection

    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [f"platform-web:{web_pid}"])
        return cursor.fetchone()[0]


def test_a_burst_of_requests_holds_no_more_than_the_pool(stack, django_db_blocker):
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("connections are counted in PostgreSQL's pg_stat_activity (set DATABASE_URL)")
    pool_size = int(stack.env["WEB_DB_POOL_SIZE"])

    def list_jobs(_):
        return requests.get(f"{stack.url}/api/v1/jobs", headers=stack.headers(), timeout=60).status_code

    most = 0
    with ThreadPoolExecutor(3 * pool_size) as pool:
        answers = [pool.submit(list_jobs, n) for n in range(10 * pool_size)]
        while not all(answer.done() for answer in answers):
            most = max(most, _web_connections(django_db_blocker, stack.web.pid))
        assert {answer.result() for answer in answers} == {200}
    assert 1 <= most <= pool_size, most
    # Given back, not leaked: a second burst borrows the same ones.
    with ThreadPoolExecutor(3 * pool_size) as pool:
        assert set(pool.map(list_jobs, range(4 * pool_size))) == {200}
    assert _web_connections(django_db_blocker, stack.web.pid) <= pool_size
