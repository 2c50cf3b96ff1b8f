"""Which model version a job runs on (issue 21): pinned when the job is created, kept to its end.

A job's rows must be consistent: a promote while it runs must not give its first rows one version's
answers and its last rows another's. So the job records the version active when it was created (or
the one its upload pinned, `model@version`), the offline child runs its chunks on that version (loading
it beside the others when needed: inference/child/versions.py), and each row records the version that
produced it. Staff may move a job to another version; its rows still to run use the new one.
"""

from __future__ import annotations

from typing import Any

from inference import deployments
from inference.core.registry import get_registry
from inference.core.versions import split_pin
from jobs.models import TERMINAL, Job


class UnknownVersion(ValueError):
    """An upload pinned a version the models file does not name."""


def model_and_version(name: str) -> tuple[str, str]:
    """`router@2` -> ("router", "2"); `router` -> ("router", "") (pinned at creation to the active one).

    UnknownVersion for a version of a known model that the models file does not name."""
    model, version = split_pin(name)
    if version is not None and get_registry().get(model) is not None:
        known = get_registry().versions_of(model)
        if version not in known:
            raise UnknownVersion(
                f"model {model!r} has no version {version!r}; its versions: {', '.join(sorted(known))}"
            )
    return model, version or ""


def pin_on_create(sender: Any, instance: Job, **_: Any) -> None:
    """pre_save of Job: a new job without a version gets the model's active one (the record of truth's)."""
    if instance._state.adding and not instance.model_version and instance.model:
        instance.model_version = deployments.active_version(instance.model)


def move(jobs: list[Job], version: str | None = None) -> int:
    """Move unfinished jobs to `version` (None: each model's active one); the rows already done keep the
    version they ran on. Returns how many moved."""
    moved = 0
    for job in jobs:
        if job.status in TERMINAL:
            continue
        target = version or deployments.active_version(job.model)
        if target and target in get_registry().versions_of(job.model) and target != job.model_version:
            Job.objects.filter(pk=job.pk).update(model_version=target)
            moved += 1
    return moved
