"""`make run` on a Redis it did not start takes a database of its own per checkout (issue #25: two
checkouts on one machine shared database 0, so queues, throttles and metrics), on a private
redis-server."""

from __future__ import annotations

import pytest
import redis

from tests.conftest import start_redis

pytestmark = pytest.mark.integration


@pytest.fixture
def server(tmp_path):
    proc, url = start_redis(tmp_path)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_each_checkout_gets_its_own_database_and_keeps_it(server):
    from scripts.run import own_database

    redis.Redis.from_url(server).set("someone-elses", "data")  # database 0 is in use by something else
    first = own_database(server, checkout="/srv/one")
    second = own_database(server, checkout="/srv/two")
    assert first != second
    assert not first.endswith("/0") and not second.endswith("/0"), "a database holding others' data was taken"
    assert own_database(server, checkout="/srv/one") == first, "a checkout moved to another database on restart"
    assert own_database(f"{server.rsplit('/', 1)[0]}/5", checkout="/srv/two") == second
