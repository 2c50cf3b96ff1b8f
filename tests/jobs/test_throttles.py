"""Per-user throttles on uploads and results: the call past the limit gets 429 with Retry-After."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from tests.jobs.factories import job_with_rows, user

pytestmark = pytest.mark.django_db

LOCAL_CACHE = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "throttle-tests"}}


@pytest.fixture
def api(settings):
    settings.CACHES = LOCAL_CACHE  # in-process: the counters need no Redis
    from django.core.cache import cache

    cache.clear()
    client = APIClient()
    owner = user("alice")
    client.force_authenticate(owner)
    client.owner = owner
    return client


def test_results_past_the_rate_get_429_with_retry_after(api, settings):
    settings.JOBS_RESULTS_RATE = "3/min"
    job = job_with_rows(api.owner)
    urls = [f"/api/v1/jobs/{job.pk}/results", f"/api/v1/jobs/{job.pk}/results.csv"]
    for i in range(3):
        assert api.get(urls[i % 2]).status_code == 200
    refused = api.get(urls[1])
    assert refused.status_code == 429
    assert 0 < int(refused["Retry-After"]) <= 60
    assert refused.json()["detail"].startswith("too many results requests: at most 3/min per user; try again in")
    # Following a job is not throttled, and another user has their own allowance.
    assert api.get(f"/api/v1/jobs/{job.pk}").status_code == 200
    other = APIClient()
    other.force_authenticate(user("bob"))
    assert other.get("/api/v1/jobs").status_code == 200


def test_uploads_past_the_rate_get_429_even_when_they_are_bad(api, settings):
    settings.JOBS_CREATE_RATE = "2/min"
    for _ in range(2):  # refused for their content (an empty file), but they still count
        assert (
            api.post("/api/v1/jobs", {"file": _file(b""), "text_column": "text"}, format="multipart").status_code == 400
        )
    refused = api.post("/api/v1/jobs", {"file": _file(b"text\nhi\n"), "text_column": "text"}, format="multipart")
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    assert "too many job uploads: at most 2/min per user" in refused.json()["detail"]


def test_an_unreachable_cache_lets_requests_through(api, settings):
    settings.JOBS_RESULTS_RATE = "1/min"
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": "redis://127.0.0.1:1/0"}
    }
    job = job_with_rows(api.owner)
    for _ in range(3):
        assert api.get(f"/api/v1/jobs/{job.pk}/results").status_code == 200


def _file(data: bytes):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile("rows.csv", data, content_type="text/csv")


def test_a_burst_across_a_windows_edge_is_held_to_the_rate(api, settings, monkeypatch):
    from jobs.api import throttles

    settings.JOBS_RESULTS_RATE = "3/min"
    job = job_with_rows(api.owner)
    clock = [60 * 1_000_000 + 58.0]  # two seconds before a minute's edge
    monkeypatch.setattr(throttles._SettingsRateThrottle, "timer", lambda self: clock[0])
    url = f"/api/v1/jobs/{job.pk}/results"
    assert [api.get(url).status_code for _ in range(3)] == [200, 200, 200]
    clock[0] += 4  # just past the edge: the sliding minute still holds the three
    refused = api.get(url)
    assert refused.status_code == 429 and 55 <= int(refused["Retry-After"]) <= 57
    clock[0] += 50  # still within a minute of them
    assert api.get(url).status_code == 429
    clock[0] += 7  # a minute after the first three: room again
    assert api.get(url).status_code == 200
