"""Names the offline jobs write to Redis, in one place.

Jobs keep their state in the database (the record of truth); in Redis they only add to the shared
metrics (fields of observability's per-second hashes) and hold the reconciler's run lock.
"""

from __future__ import annotations

# The reconciler's Periodic name: its lock is `periodic:<name>:lock` (platform_/periodic.py).
RECONCILER = "jobs-reconciler"
# Seconds offline children spent yielding to online work (all models).
OFFLINE_YIELD_FIELD = "oyield_s|all"


def offline_rows_field(model: str) -> str:
    """Rows an offline job wrote for `model` (metric field; /metrics: offline_rows_total)."""
    return f"orows|{model}"


def offline_inference_field(model: str) -> str:
    """Seconds offline children spent in forward passes for `model` (/metrics: offline_inference_seconds_total)."""
    return f"oinfer_s|{model}"
