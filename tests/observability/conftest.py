"""The observability tests' own Redis database: each module names its `DB`, so windows and gauges it
writes never mix with the live stack's (database 0) or another module's."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pytest
import redis


@pytest.fixture
def client(redis_url, request):
    """A client on the test module's database (its `DB`), flushed before and after the test."""
    db = request.module.DB
    # The URL's own database number wins over a db= argument: replace it, never flush the suite's database.
    c = redis.Redis.from_url(urlunsplit(urlsplit(redis_url)._replace(path=f"/{db}")), decode_responses=True)
    assert c.connection_pool.connection_kwargs["db"] == db
    c.flushdb()
    yield c
    c.flushdb()
