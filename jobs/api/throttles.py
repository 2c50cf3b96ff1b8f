"""Per-user rate limits on the jobs API and pages: uploads, results, listing and retries, so one client
cannot swamp the others. The pages (jobs/views.py) count against the same counters as the API.

DRF's UserRateThrottle with the rate read from settings at request time (DRF binds its rates at
import, which environment-driven settings and test overrides would miss). Counters live in Django's
cache, which settings put in Redis, so all web processes share them. If the cache is unreachable the
request goes through: a throttle is a guard, and refusing all uploads because Redis blinked is worse.
"""

from __future__ import annotations

import logging
import math

from django.conf import settings
from rest_framework import exceptions
from rest_framework.throttling import UserRateThrottle

logger = logging.getLogger(__name__)


class _SettingsRateThrottle(UserRateThrottle):
    setting = ""
    default_rate = ""
    #: What is limited, for the 429 message.
    what = ""

    def get_rate(self) -> str:
        return getattr(settings, self.setting, self.default_rate)

    # The period (a minute for "60/min") is counted in this many slots, each a cache counter.
    SLOTS = 60

    def allow_request(self, request, view) -> bool:
        """A sliding period counted in SLOTS cache counters, each incremented atomically (the cache's INCR).

        DRF's own throttle reads a user's history and writes it back, so requests sent at once all read
        the same history and pass together (70 concurrent batch creations got 66 through a 60/min limit).
        Here each request first counts itself, then reads the period's total, which holds every request
        counted before it: of requests sent at once, no more than the rate pass. A refused one takes its
        count back.
        """
        try:
            if self.rate is None:
                return True
            self.key = self.get_cache_key(request, view)
            if self.key is None:
                return True
            limit, duration = self.parse_rate(self.get_rate())
            width = duration / self.SLOTS
            now = self.timer()
            slot = int(now // width)
            mine = f"{self.key}:s{slot}"
            self.cache.add(mine, 0, timeout=duration + width + 1)
            self.cache.incr(mine)
            slots = list(range(slot - self.SLOTS + 1, slot + 1))
            found = self.cache.get_many([f"{self.key}:s{s}" for s in slots])
            counts = [int(found.get(f"{self.key}:s{s}", 0)) for s in slots]
            if sum(counts) <= limit:
                return True
            self.cache.decr(mine)
            # Until enough of the oldest requests have slid out of the period for this one to fit.
            excess, freed = sum(counts) - limit, 0
            for s, count in zip(slots, counts, strict=True):
                freed += count
                if freed >= excess:
                    self._wait_s = max(1.0, (s + self.SLOTS) * width - now)  # when slot s leaves the period
                    break
            return False
        except Exception:  # the cache backend's own errors (redis.ConnectionError, ...): fail open
            logger.warning("jobs throttle %s: cache unavailable, not throttling", self.scope, exc_info=True)
            return True

    def wait(self) -> float | None:
        return getattr(self, "_wait_s", None)


def refusal(throttle: _SettingsRateThrottle, wait_s: float | None) -> str:
    """The 429's message, said once: what is limited, the rate, and when to try again."""
    retry = f"; try again in {math.ceil(wait_s)} s" if wait_s is not None else ""
    return f"too many {throttle.what}: at most {throttle.get_rate()} per user{retry}"


def refused_wait_s(throttle_class: type[_SettingsRateThrottle], request) -> float | None:
    """For views outside DRF (the pages): count this request; None if it may go on, else the seconds
    until it may (at least 1). A DRF view lists its throttles instead (get_throttles)."""
    throttle = throttle_class()
    if throttle.allow_request(request, None):
        return None
    return throttle.wait() or 1.0


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


class ListThrottle(_SettingsRateThrottle):
    """Listing jobs: a page is at most 200 jobs, but each costs a look at where it stands in the backlog."""

    scope = "jobs_list"
    setting = "JOBS_LIST_RATE"
    default_rate = "600/min"
    what = "job list requests"


class RetryThrottle(_SettingsRateThrottle):
    """Retrying a job's failed rows puts them back in the fair share and ends the job again."""

    scope = "jobs_retry"
    setting = "JOBS_RETRY_RATE"
    default_rate = "10/min"
    what = "retries"


def throttled(throttle: _SettingsRateThrottle | None, wait_s: float | None) -> exceptions.Throttled:
    """DRF's 429 with our message and its Retry-After. The wait is set after construction: given to
    Throttled(), DRF would append "Expected available in N seconds." to a message that says it already."""
    detail = refusal(throttle, wait_s) if throttle else "too many requests; try again later"
    error = exceptions.Throttled(detail=detail)
    error.wait = math.ceil(wait_s) if wait_s is not None else None
    return error
