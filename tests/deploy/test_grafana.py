"""The compose `observability` profile: Prometheus's scrape config, Grafana's provisioning and dashboard.

The dashboard's queries are checked against what a live platform really exports: every metric and
label a panel names must be on a real /metrics scrape after real traffic, and, where Debian's
`prometheus` package is installed, a real Prometheus scrapes the test stack and runs every query.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/dashboards/inference-platform.json"
DATASOURCE = ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml"
PROVIDER = ROOT / "deploy/grafana/provisioning/dashboards/platform.yml"
PROMETHEUS = ROOT / "deploy/prometheus/prometheus.yml"
COMPOSE = ROOT / "docker-compose.yml"

# The platform's own metric names all start so; anything else in a query is PromQL or a label.
METRIC = re.compile(r"\b((?:inference|offline|platform)_[a-z0-9_]+)\b")
SELECTOR = re.compile(r"\b((?:inference|offline|platform)_[a-z0-9_]+)\s*\{([^}]*)\}")
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] if p["type"] != "row" for t in p["targets"]]


def family_of(name: str, families: dict[str, set[str]]) -> str | None:
    """The exported family a series name belongs to (histograms and counters add suffixes)."""
    if name in families:
        return name
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in families:
            return name[: -len(suffix)]
    return None


def labels_used(expr: str) -> dict[str, set[str]]:
    """Per metric in `expr`, the labels its selectors match on and the `by (...)` groupings around it use."""
    used: dict[str, set[str]] = {m: set() for m in METRIC.findall(expr)}
    for metric, matchers in SELECTOR.findall(expr):
        used[metric] |= {m.split("=")[0].strip(" !~") for m in matchers.split(",") if m.strip()}
    grouped = {label.strip() for group in GROUPING.findall(expr) for label in group.split(",") if label.strip()}
    for metric in used:
        # A grouping names labels of every metric inside it; `le` is the histogram's own.
        used[metric] |= grouped - {"le"}
    return used


# Files alone ------------------------------------------------------------------------------------


def test_dashboard_panels_are_well_formed():
    board = dashboard()
    datasource = yaml.safe_load(DATASOURCE.read_text())["datasources"][0]
    panels = board["panels"]
    assert board["uid"] and board["title"] and board["refresh"] == "5s"
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], f"{panel['title']} has no unit"
        assert panel["description"], panel["title"]
        assert panel["targets"] and all(
            t["expr"] and t["datasource"]["uid"] == datasource["uid"] for t in panel["targets"]
        )
    # No two panels overlap.
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps another panel"
                cells.add((x, y))


def test_dashboard_covers_the_django_dashboard():
    """The figures the Django dashboard shows, each in some panel's query."""
    exprs = "\n".join(expr for _, expr in queries())
    for needle in (
        "inference_requests_total",  # requests by status
        "inference_admission_refusals_total",  # refusals
        "histogram_quantile(0.5,",
        "histogram_quantile(0.95,",
        "histogram_quantile(0.99,",
        "inference_stage_latency_seconds_bucket",
        "platform_queue_depth",
        "platform_queue_predicted_wait_seconds",
        "inference_batch_size",
        "inference_batch_fill_ratio",
        "platform_worker_processes",
        "platform_worker_memory_bytes",
        "offline_rows_total",
        "platform_host_cpu_percent",
        "platform_host_load1",
    ):
        assert needle in exprs, f"no panel shows {needle}"
    assert "by (status)" in exprs, "requests are broken down by status class"


def test_grafana_provisioning_points_at_the_mounted_files():
    provider = yaml.safe_load(PROVIDER.read_text())["providers"][0]
    datasource = yaml.safe_load(DATASOURCE.read_text())["datasources"][0]
    grafana = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"] if v.startswith("./")}
    assert (ROOT / mounts[provider["options"]["path"]]).resolve() == DASHBOARD.parent.resolve()
    assert (ROOT / mounts["/etc/grafana/provisioning"]).resolve() == DATASOURCE.parent.parent.resolve()
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"


def test_prometheus_scrapes_web_with_the_metrics_token():
    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["web:8000"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": "/etc/prometheus/metrics_token"}
    prometheus = yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]
    assert "/etc/prometheus/metrics_token" in prometheus["command"][0]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]


def test_observability_services_are_an_optional_profile():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert services["prometheus"]["profiles"] == ["observability"]
    assert services["grafana"]["profiles"] == ["observability"]
    # Optional profiles: observability (these two) and sentinel (Redis replica and sentinels, issue 22).
    optional = {name for name, s in services.items() if s.get("profiles") in (["observability"], ["sentinel"])}
    assert {name for name, s in services.items() if s.get("profiles") == ["sentinel"]} == {
        "redis-replica", "redis-sentinel-1", "redis-sentinel-2", "redis-sentinel-3",
    }  # fmt: skip
    others = [name for name in services if name not in optional]
    assert all("profiles" not in services[name] for name in others), "the platform itself runs without a profile"
    assert {"web", "redis", "postgres", "proxy", "worker-offline"} <= set(others)
    for name in ("prometheus", "grafana"):
        assert services[name]["ports"][0].startswith("${"), f"{name} binds where the operator says (default 127.0.0.1)"


def _compose_client() -> list[str] | None:
    """docker-compose (v1, Debian's package), else the docker CLI's compose plugin, else None."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


@pytest.mark.skipif(
    _compose_client() is None, reason="no compose client (apt-get install docker-compose; .ci/run does)"
)
def test_compose_config_with_the_profile():
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "DJANGO_SECRET_KEY": "x", "POSTGRES_PASSWORD": "x"}
    env |= {"FLOWER_BASIC_AUTH": "a:b", "METRICS_TOKEN": "t", "GRAFANA_ADMIN_PASSWORD": "g"}
    client = _compose_client()
    result = subprocess.run(
        [*client, "--profile", "observability", "config"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)["services"]
    assert {"prometheus", "grafana"} <= set(rendered)


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed (Debian package prometheus)")
def test_promtool_check_config(tmp_path):
    """promtool stats the token file, so the check runs on a copy whose token file exists."""
    token = tmp_path / "metrics_token"
    token.write_text("t")
    config = tmp_path / "prometheus.yml"
    config.write_text(PROMETHEUS.read_text().replace("/etc/prometheus/metrics_token", str(token)))
    result = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# Against a live platform -------------------------------------------------------------------------


def traffic(stack, job: bool = True) -> None:
    """Answered and refused predictions, and a small offline job, so every counter has samples."""
    for i in range(6):
        assert stack.predict("router", [f"my parcel {i} is late"]).status_code == 200
    assert stack.predict("router", []).status_code == 400
    if not job:
        return
    csv = "text\n" + "".join(f"row {i} about a refund\n" for i in range(60))
    response = requests.post(
        f"{stack.url}/api/v1/jobs",
        files={"file": ("g.csv", csv.encode())},
        data={"model": "router"},
        headers={"Authorization": f"Token {stack.token}"},
        timeout=30,
    )
    assert response.status_code in (201, 202), response.text


def scrape(stack) -> dict[str, set[str] | None]:
    """Each metric family on /metrics, with the label names its samples carry (None: declared, no sample
    yet, as the refusals counter before any refusal)."""
    from django.conf import settings

    response = requests.get(
        f"{stack.url}/metrics", headers={"Authorization": f"Bearer {settings.METRICS_TOKEN}"}, timeout=10
    )
    assert response.status_code == 200, response.text
    families: dict[str, set[str] | None] = {}
    for family in text_string_to_metric_families(response.text):
        labels = {label for sample in family.samples for label in sample.labels}
        families[family.name] = labels if family.samples else None
    return families


def test_every_query_uses_metrics_and_labels_the_platform_exports(stack):
    traffic(stack)
    wanted = {m for _, expr in queries() for m in METRIC.findall(expr)}
    # Counters that only a refusal (or an error) fills may stay without samples; the rest must have some.
    may_be_empty = {"inference_admission_refusals_total"}

    def all_there():
        families = scrape(stack)
        found = {m: family_of(m, families) for m in wanted}
        missing = {m for m, f in found.items() if f is None or (families[f] is None and m not in may_be_empty)}
        return families if not missing else None

    try:
        families = wait_until(all_there, 90, "every metric the dashboard uses on /metrics", interval_s=1.0)
    except TimeoutError:
        families = scrape(stack)
        missing = sorted(m for m in wanted if family_of(m, families) is None)
        empty = sorted(m for m in wanted if m not in missing and families[family_of(m, families)] is None)
        pytest.fail(f"the dashboard queries metrics /metrics does not export: {missing}; without samples: {empty}")
    for title, expr in queries():
        for metric, labels in labels_used(expr).items():
            exported = families[family_of(metric, families)]
            if exported is None:
                continue  # declared without samples: its labels cannot be read here
            unknown = labels - exported
            assert not unknown, f"panel {title!r}: {metric} has no label {sorted(unknown)} (it has {sorted(exported)})"


@pytest.mark.skipif(not shutil.which("prometheus"), reason="no prometheus binary (Debian package prometheus)")
def test_every_query_runs_on_prometheus_scraping_the_platform(stack, tmp_path):
    """A real Prometheus scrapes the test stack every second; each panel's query must parse and the core
    ones must return series (rates need two scrapes inside their window, so traffic runs meanwhile)."""
    from django.conf import settings

    token = tmp_path / "metrics_token"
    token.write_text(settings.METRICS_TOKEN)
    config = yaml.safe_load(PROMETHEUS.read_text())
    config["global"] |= {"scrape_interval": "1s", "scrape_timeout": "1s"}
    job = config["scrape_configs"][0]
    job["authorization"]["credentials_file"] = str(token)
    job["static_configs"] = [{"targets": [stack.url.removeprefix("http://")]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    api = f"http://127.0.0.1:{port}/api/v1"
    try:

        def up() -> bool:
            try:
                result = requests.get(f"{api}/query", params={"query": "up"}, timeout=2).json()["data"]["result"]
            except (requests.ConnectionError, KeyError, ValueError):
                return False
            return bool(result) and result[0]["value"][1] == "1"

        wait_until(up, 60, "Prometheus scraping the test stack's /metrics")
        # Refusals need refused traffic; the rest must show the traffic once Prometheus has scraped it twice.
        core = {"Answered per second", "Requests by status", "Requests by model and outcome", "Batch size"}
        core |= {"Latency P50 / P95 / P99", "Queue depth", "Worker processes", "Worker memory"}
        core |= {"Offline rows per second", "Host CPU"}

        def run_all() -> list[str]:
            empty = []
            for title, expr in queries():
                # $__rate_interval is Grafana's (at least four scrapes): 1m here, as in most panels.
                answer = requests.get(
                    f"{api}/query", params={"query": expr.replace("$__rate_interval", "1m")}, timeout=10
                ).json()
                assert answer["status"] == "success", f"panel {title!r}: {answer.get('error')}"
                if not answer["data"]["result"]:
                    empty.append(title)
            return empty

        traffic(stack)

        def core_has_data() -> bool:
            traffic(stack, job=False)
            return not core & set(run_all())

        try:
            wait_until(core_has_data, 90, "data in every core panel", interval_s=1.0)
        except TimeoutError:
            pytest.fail(f"panels with no data after traffic: {sorted(core & set(run_all()))}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
