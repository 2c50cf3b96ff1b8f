"""Who may see and act on which jobs: one rule for the API, the pages and the admin.

A user always has full access to their own jobs. Another user's job is reached only with the admin's
model permissions, and only by staff (the admin lets no one else in): seeing it (list, detail) needs
`jobs.view_job`, its rows (results, exports, the page's row table) also `jobs.view_jobrow`, and
changing it (cancel, retry) `jobs.change_job`. As in the admin, a change permission implies the view
permission of the same model. Anything a user may not see is a 404, as a job that does not exist: a
403 would confirm that the id is someone's job.
"""

from __future__ import annotations

import enum

from django.db.models import QuerySet

from jobs.models import Job


class Access(enum.Enum):
    """What a request does with a job, from least to most."""

    VIEW = "view"  # list, detail, summary
    ROWS = "rows"  # results, exports, the rows on the page
    CHANGE = "change"  # cancel, retry


def _may(user, action: str, model: str) -> bool:
    # has_perm is False for an inactive user, and True for every permission of an active superuser.
    return bool(user.is_staff and user.has_perm(f"jobs.{action}_{model}"))


def _may_view(user, model: str) -> bool:
    return _may(user, "view", model) or _may(user, "change", model)


def reaches_others(user, access: Access) -> bool:
    """Whether `user` may do `access` to other users' jobs (their own are always theirs)."""
    if not user.is_authenticated:
        return False
    if access is Access.CHANGE:
        return _may(user, "change", "job")
    if access is Access.ROWS:
        return _may_view(user, "job") and _may_view(user, "jobrow")
    return _may_view(user, "job")


def allows(user, job: Job, access: Access) -> bool:
    """Whether `user` may do `access` to this job."""
    return job.owner_id == user.pk or reaches_others(user, access)


def visible_jobs(user, access: Access = Access.VIEW) -> QuerySet[Job]:
    """The jobs `user` may do `access` to: their own, and everyone's where the permissions allow; newest
    first, in a stable order, so that pages neither repeat nor skip a job created in the same instant."""
    jobs = Job.objects.select_related("owner", "batch").order_by("-created_at", "-pk")
    return jobs if reaches_others(user, access) else jobs.filter(owner_id=user.pk)
