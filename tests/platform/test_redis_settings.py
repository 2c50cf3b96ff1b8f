"""REDIS_SENTINELS turns every Redis client of the platform towards the sentinels; unset, nothing changes.

Settings are read once per process, so each case imports them in a fresh interpreter with its own
environment and reports what Celery, Django's cache and the platform's own clients were configured with.
The failover itself is shown live in test_redis_sentinel.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT

_REPORT = """
import json
from django.conf import settings
from platform_.celery import app
from platform_.redis import get_redis
pool = get_redis().connection_pool
print(json.dumps({
    "broker_url": app.conf.broker_url,
    "result_backend": app.conf.result_backend,
    "broker_options": app.conf.broker_transport_options,
    "result_options": app.conf.result_backend_transport_options,
    "cache_options": settings.CACHES["default"].get("OPTIONS", {}),
    "pool": type(pool).__name__,
    "service": getattr(pool, "service_name", None),
    "db": pool.connection_kwargs.get("db"),
    "password": pool.connection_kwargs.get("password"),
    "host": pool.connection_kwargs.get("host"),
}))
"""


def configured(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("REDIS_")}
    done = subprocess.run(
        [sys.executable, "-c", _REPORT],
        cwd=ROOT,
        env={**clean, "DJANGO_SETTINGS_MODULE": "platform_.settings.test", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_without_sentinels_every_client_uses_redis_url_as_before():
    seen = configured(REDIS_URL="redis://:secret@cache-host:6380/4")
    assert seen["broker_url"] == seen["result_backend"] == "redis://:secret@cache-host:6380/4"
    assert "master_name" not in seen["broker_options"] and not seen["result_options"]
    assert seen["cache_options"] == {}
    assert (seen["pool"], seen["host"], seen["db"], seen["password"]) == ("ConnectionPool", "cache-host", 4, "secret")


def test_with_sentinels_celery_the_cache_and_the_platform_clients_ask_them_for_the_primary():
    seen = configured(
        REDIS_URL="redis://:secret@ignored-host:6379/4",
        REDIS_SENTINELS="10.0.0.5:26379, sentinel-b:26380",
        REDIS_SENTINEL_MASTER="main",
        REDIS_SENTINEL_PASSWORD="sentinel-secret",
    )
    expected = "sentinel://:secret@10.0.0.5:26379/4;sentinel://:secret@sentinel-b:26380/4"
    assert seen["broker_url"] == seen["result_backend"] == expected
    sentinel_options = {"master_name": "main", "sentinel_kwargs": {"password": "sentinel-secret"}}
    assert seen["broker_options"].pop("visibility_timeout") > 0  # kept beside the sentinel options
    # A frozen primary is left after REDIS_SOCKET_TIMEOUT_S (default 5 s), by commands and by the BRPOP check.
    timeouts = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0, "health_check_interval": 5}
    assert seen["broker_options"] == {**sentinel_options, **timeouts}
    assert seen["result_options"] == sentinel_options
    assert seen["cache_options"] == {"pool_class": "platform_.redis.SentinelCachePool"}
    # The platform's own client: the sentinels' primary, with REDIS_URL's password and database only.
    assert (seen["pool"], seen["service"], seen["db"], seen["password"]) == (
        "SentinelConnectionPool",
        "main",
        4,
        "secret",
    )
