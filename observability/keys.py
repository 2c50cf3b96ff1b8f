"""Redis key names of the observability app, in one place (tests import them too).

- `metrics:s:<epoch second>`: one hash per second (counters, histogram buckets, sampled gauges), for
  windows and charts; expires after metrics.HISTORY_S.
- `metrics:total`: the same counters over the platform's lifetime, for /metrics.
- `metrics:gauges`: the latest sample of every gauge, plus `sampled_at`.
"""

from __future__ import annotations

TOTAL_KEY = "metrics:total"
GAUGES_KEY = "metrics:gauges"


def second_key(second: int) -> str:
    return f"metrics:s:{second}"
