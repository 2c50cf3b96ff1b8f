"""The host's own troubleshooting rule, and what other apps' rules ask about the host.

A rule is a function of a `Snapshot` that returns a `Finding` when its row of the table holds, an
`Unevaluated` when its figures are missing, or None. The online rules live with the figures they
read (inference/web/diagnosis.py); this one reads only the host gauges the sampler writes.
"""

from __future__ import annotations

from observability.diagnosis import Finding, Snapshot, ms

# All cores this busy, with more runnable threads than cores: processes queue for a CPU, and every
# stage (web, dispatcher, children, Redis) slows together. Below it, a slow service is not the host.
HOST_CPU_BUSY_PCT = 90.0
# A symptom worth naming: a busy host that still answers fast is a well-used host, not a jam.
SLOW_P99_S = 0.5
CHILDREN_COMPUTING = 0.85


def host_is_saturated(s: Snapshot) -> bool:
    """Host CPU busy and its load above its cores: the CPU is what everything waits for."""
    if s.host_cpu_pct is None or s.host_load1 is None:
        return False
    return s.host_cpu_pct >= HOST_CPU_BUSY_PCT and s.host_load1 > (s.host_cores or 1)


def host_saturated(s: Snapshot) -> Finding | None:
    """Host CPU starved: told apart from a lock (idle children, slow answers, but a busy host)."""
    slow = (s.p99_s is not None and s.p99_s >= SLOW_P99_S) or s.timeouts_per_s > 0
    # Children busy nearly all the time on a saturated host: they are what uses the CPU, and that is
    # compute saturation (more hosts), not starvation (fewer processes per host).
    computing = s.busy_fraction is not None and s.busy_fraction >= CHILDREN_COMPUTING
    if not (host_is_saturated(s) and slow) or computing:
        return None
    return Finding(
        "host_saturated",
        "host CPU saturated (every process waits for a core)",
        f"host CPU {s.host_cpu_pct:.0f}% busy, load {s.host_load1:.1f} on {s.host_cores or '?'} cores, "
        f"P99 {ms(s.p99_s)}, {s.timeouts_per_s:.2f} timeouts/s; online children busy "
        f"{(s.busy_fraction or 0) * 100:.0f}% of the time",
        "fewer worker children per host (each competes with the web tier and Redis for the same cores), "
        "move load generators and other work off the host, or add hosts; adding children here makes it worse",
    )
