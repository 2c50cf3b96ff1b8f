"""The dashboard's running jobs and per-user offline work follow the jobs paths' rule (jobs/permissions.py):
staff without the admin's permission to view jobs see only their own (issue #25)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission

from jobs.monitoring import dashboard_for

pytestmark = pytest.mark.django_db


def _staff(name: str, *perms: str):
    user = get_user_model().objects.create_user(name, password="pw-for-tests-123", is_staff=True)
    for codename in perms:
        user.user_permissions.add(Permission.objects.get(content_type__app_label="jobs", codename=codename))
    return get_user_model().objects.get(pk=user.pk)  # permissions are cached per instance


def _data() -> dict:
    return {
        "jobs": [
            {"id": 1, "owner": "alice", "filename": "alice-secret.csv"},
            {"id": 2, "owner": "bare", "filename": "mine.csv"},
        ],
        "offline_users": [{"user": "alice", "rows_queued": 10}, {"user": "bare", "rows_queued": 5}],
        "online": {"qps": 3.0},
    }


def test_staff_without_the_view_permission_see_only_their_own_jobs():
    shown = dashboard_for(_data(), _staff("bare"))
    assert [job["id"] for job in shown["jobs"]] == [2]
    assert [row["user"] for row in shown["offline_users"]] == ["bare"]
    assert shown["jobs_hidden"] == 1
    assert shown["online"] == {"qps": 3.0}, "the platform's own figures stay"


def test_staff_with_the_view_permission_see_everyones():
    shown = dashboard_for(_data(), _staff("viewer", "view_job"))
    assert [job["id"] for job in shown["jobs"]] == [1, 2] and "jobs_hidden" not in shown
