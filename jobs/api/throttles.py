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
        """A sliding window from two fixed windows' counters, each incremented atomically (the cache's INCR).

        DRF's own throttle reads a user's history and writes it back, so requests sent at once all read
        the same history and pass together (70 concurrent batch creations got 66 through a 60/min limit).
        Here the estimate is the current window's count plus the previous window's, weighted by how much
        of it the sliding window still covers: a burst across a window's edge is held to the rate too.
        """
        try:
            if self.rate is None:
                return True
            self.key = self.get_cache_key(request, view)
            if self.key is None:
                return True
            limit, duration = self.parse_rate(self.get_rate())
            now = self.timer()
            window = int(now // duration)
            current = f"{self.key}:w{window}"
            self.cache.add(current, 0, timeout=2 * duration + 1)
            count = self.cache.incr(current)
            previous = self.cache.get(f"{self.key}:w{window - 1}") or 0
            into = (now - window * duration) / duration  # how far into the current window, 0 to 1
            if previous * (1 - into) + count <= limit:
                return True
            self.cache.decr(current)  # a refused request does not count against the next ones
            if count > limit or previous == 0:
                self._wait_s = (window + 1) * duration - now
            else:  # when the previous window's weight has fallen enough for one more request
                self._wait_s = max(1.0, duration * (1 - (limit - count) / previous) - (now - window * duration))
            return False
        except Exception:  # the cache backend's own errors (redis.ConnectionError, ...): fail open
            logger.warning("jobs throttle %s: cache unavailable, not throttling", self.scope, exc_info=True)
            return True

    def wait(self) -> float | None:
        return getattr(self, "_wait_s", None)


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
