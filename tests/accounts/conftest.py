"""Fixtures of the accounts tests: an empty Redis database of their own, users and key clients."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from rest_framework.test import APIClient

import platform_.redis

DB = 6  # the accounts tests' own Redis database (last-used notes, usage counters, rate buckets)


@pytest.fixture
def own_redis(settings, redis_url, monkeypatch) -> redis.Redis:
    url = urlunsplit(urlsplit(redis_url)._replace(path=f"/{DB}"))
    settings.REDIS_URL = url
    monkeypatch.setattr(platform_.redis, "_sync", None)
    client = redis.Redis.from_url(url, decode_responses=True)
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture
def make_user(db):
    from django.contrib.auth import get_user_model

    def make(username: str, **extra):
        return get_user_model().objects.create_user(username=username, password="x" * 12, **extra)

    return make


def key_client(raw: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client
