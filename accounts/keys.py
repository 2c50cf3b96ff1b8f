"""Redis key names of this app, in one place (the code and the tests import them from here)."""

from __future__ import annotations

# API key id -> epoch seconds of its last use, until the periodic flush writes them to the database.
LAST_USED_KEY = "accounts:last-used"


def usage_day_key(day: object) -> str:
    """One UTC day's usage counters: `user|key|model|metric` -> count (accounts/usage.py)."""
    return f"accounts:usage:{day}"


# A day's counters being moved into the database: `accounts:usage-flushing:<day>:<run>`.
USAGE_FLUSHING_PREFIX = "accounts:usage-flushing:"


def bucket_key(scope: str, owner_id: int) -> str:
    """A user's or key's token bucket of online calls (accounts/quotas.py): hash {level, at_ms}."""
    return f"accounts:bucket:{scope}:{owner_id}"


def day_tokens_key(day: object) -> str:
    """One UTC day's tokens per `user:<id>` and `key:<id>`, what the daily token limits are checked against."""
    return f"accounts:day-tokens:{day}"
