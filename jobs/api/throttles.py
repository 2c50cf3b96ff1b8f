"""Per-user rate limits on the jobs API: uploads and results, so one client cannot swamp the others.

DRF's UserRateThrottle with the rate read from settings at request time (DRF binds its rates at
import, which environment-driven settings and test overrides would miss). Counters live in Django's
cache, which settings put in Redis, so all web processes share them. If the cache is unreachable the
request goes through: a throttle is a guard, and refusing all uploads because Redis blinked is worse.
"""

from __future__ import annotations

import logging

from django.conf import settings
from rest_framework.throttling import UserRateThrottle

logger = logging.getLogger(__name__)


class _SettingsRateThrottle(UserRateThrottle):
    setting = ""
    default_rate = ""
    #: What is limited, for the 429 message.
    what = ""

    def get_rate(self) -> str:
        return getattr(settings, self.setting, self.default_rate)

    def allow_request(self, request, view) -> bool:
        try:
            return super().allow_request(request, view)
        except Exception:  # the cache backend's own errors (redis.ConnectionError, ...): fail open
            logger.warning("jobs throttle %s: cache unavailable, not throttling", self.scope, exc_info=True)
            return True


class JobCreateThrottle(_SettingsRateThrottle):
    scope = "jobs_create"
    setting = "JOBS_CREATE_RATE"
    default_rate = "60/min"
    what = "job uploads"


class ResultsThrottle(_SettingsRateThrottle):
    scope = "jobs_results"
    setting = "JOBS_RESULTS_RATE"
    default_rate = "600/min"
    what = "results requests"
