"""What other apps tell observability, registered from their AppConfig.ready().

- gauges: `fn(client) -> {"gauge|<what>|<queue>": value}`, called by the sampler once a second;
- snapshot sources: `fn(client, snapshot, seconds, now)` fill the diagnosis figures only that app
  can read (heartbeats, drain-rate buckets);
- rules: `fn(snapshot) -> Finding | None`, one row of the troubleshooting table each;
- dashboard sections: `fn(client, now) -> {field: value}`, merged into the dashboard's data;
- metric families: `fn(totals, gauges) -> iterable of prometheus_client metric families`, added to /metrics
  (an app's own series from the counters and gauges it writes, parsed with its own key names);
- housekeeping: `fn()` run by the sampler's tick every `interval_s` (retention of the app's logs);
- version roles: `fn(client) -> {model: {version: role}}` ("active", "canary"), how the dashboard's
  Versions table marks each version (the app that deploys versions knows which is which).

Registering twice (ready() runs once per process, but tests may call it again) keeps one entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

GaugeSource = Callable[[Any], dict[str, float]]
SnapshotSource = Callable[[Any, Any, list[dict[str, float]], float], None]
Rule = Callable[[Any], Any]
DashboardSection = Callable[[Any, float], dict[str, Any]]
DashboardFilter = Callable[[dict[str, Any], Any], dict[str, Any]]
MetricFamilies = Callable[[Mapping[str, float], Mapping[str, float]], Iterable[Any]]
VersionRoles = Callable[[Any], Mapping[str, Mapping[str, str]]]

_gauges: list[GaugeSource] = []
_snapshot_sources: list[SnapshotSource] = []
_rules: list[Rule] = []
_dashboard_sections: list[DashboardSection] = []
_dashboard_filters: list[DashboardFilter] = []
_metric_families: list[MetricFamilies] = []
_housekeeping: list[tuple[Callable[[], object], float]] = []
_version_roles: list[VersionRoles] = []


def _add(registry: list, item) -> None:
    if item not in registry:
        registry.append(item)


def register_gauges(fn: GaugeSource) -> None:
    _add(_gauges, fn)


def register_snapshot_source(fn: SnapshotSource) -> None:
    _add(_snapshot_sources, fn)


def register_rule(*fns: Rule) -> None:
    """Rules are evaluated, and their findings listed, in the order they were registered."""
    for fn in fns:
        _add(_rules, fn)


def register_dashboard(fn: DashboardSection) -> None:
    _add(_dashboard_sections, fn)


def register_dashboard_filter(fn: DashboardFilter) -> None:
    """`fn(data, user)` returns the dashboard's data as this viewer may see it (an app hides its tenants'
    details from staff without its permissions)."""
    _add(_dashboard_filters, fn)


def register_metric_families(fn: MetricFamilies) -> None:
    _add(_metric_families, fn)


def register_housekeeping(fn: Callable[[], object], interval_s: float) -> None:
    _add(_housekeeping, (fn, interval_s))


def register_version_roles(fn: VersionRoles) -> None:
    _add(_version_roles, fn)


def gauge_sources() -> list[GaugeSource]:
    return list(_gauges)


def snapshot_sources() -> list[SnapshotSource]:
    return list(_snapshot_sources)


def rules() -> list[Rule]:
    return list(_rules)


def dashboard_sections() -> list[DashboardSection]:
    return list(_dashboard_sections)


def dashboard_filters() -> list[DashboardFilter]:
    return list(_dashboard_filters)


def metric_families() -> list[MetricFamilies]:
    return list(_metric_families)


def housekeeping() -> list[tuple[Callable[[], object], float]]:
    return list(_housekeeping)


def version_roles() -> list[VersionRoles]:
    return list(_version_roles)
