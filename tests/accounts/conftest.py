"""Fixtures of the accounts tests: an empty Redis database of their own, users and key clients."""

from __future__ import annotations

import pytest
import redis
from rest_framework.test import APIClient

from tests.conftest import own_redis_database

DB = 6  # the accounts tests' own Redis database (last-used notes, usage counters, rate buckets)


@pytest.fixture
def own_redis(settings, redis_url, monkeypatch) -> redis.Redis:
    yield from own_redis_database(settings, redis_url, monkeypatch, DB)


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
