"""Project package: settings, URLs, the Celery app. Not named `platform`, which would shadow the stdlib module."""

from __future__ import annotations

from .celery import app as celery_app

__all__ = ["celery_app"]
