"""docker-compose.yml runs more than one process per role: what `docker compose up --scale worker-router=3` needs,
checked on the parsed file (no Docker engine here; `docker compose config` too where a client answers)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml
from django.conf import settings

from inference.core.queues import online_queues
from inference.core.registry import parse_registry
from tests.conftest import ROOT

COMPOSE = ROOT / "docker-compose.yml"
MARGIN_S = 10


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def queue_of(service: dict[str, Any]) -> str | None:
    command = service.get("command") or []
    if command[:4] == ["celery", "-A", "platform_", "worker"]:
        return command[command.index("-Q") + 1]
    return None


def workers(services: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Worker services by queue."""
    found: dict[str, str] = {}
    for name, service in services.items():
        queue = queue_of(service)
        if queue is not None:
            assert queue not in found, f"{found[queue]} and {name} both consume {queue}"
            found[queue] = name
    return found


def duration_s(text: str) -> float:
    """Compose's duration format: 45s, 31m, 1h30m, 1m30s."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    assert parts and text, f"not a duration: {text!r}"
    hours, minutes, secs = (int(p or 0) for p in parts.groups())
    return hours * 3600 + minutes * 60 + secs


def test_one_worker_service_per_online_group_of_the_models_file_and_one_offline(services):
    raw = yaml.safe_load((ROOT / "inference" / "models.yaml").read_text())
    groups = online_queues(parse_registry(raw, device="cpu", torch_threads=1, max_backlog=1))
    assert set(workers(services)) == {*groups, "offline"}


def test_every_worker_can_be_scaled_out(services):
    for name in workers(services).values():
        service = services[name]
        assert "container_name" not in service, name
        assert "ports" not in service, f"{name}: a published port would clash at --scale {name}=2"
        command = service["command"]
        # Named after its container, so each replica's heartbeats and probe are its own.
        assert command[command.index("-n") + 1].endswith("@%h"), name
    assert not any("container_name" in s for s in services.values())


def test_the_api_is_published_only_through_the_proxy_on_a_configurable_port(services):
    assert "ports" not in services["web"], "web is reached through nginx (`proxy`), never directly"
    (port,) = services["proxy"]["ports"]
    assert port.startswith("${WEB_PORT:-8000}:"), port
    # The web believes X-Forwarded-For from nginx's fixed address, and from no one else.
    address = services["proxy"]["networks"]["default"]["ipv4_address"]
    assert services["web"]["environment"]["FORWARDED_ALLOW_IPS"] == address


def test_every_long_running_service_has_a_healthcheck_and_restarts(services):
    for name, service in services.items():
        if name == "migrate":
            assert service["restart"] == "no"  # a one-off: its failure must stop the rest, not loop
            continue
        assert service.get("restart") in ("unless-stopped", "always"), name
        assert "healthcheck" in service, name
    for name in workers(services).values():
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "manage.py", "worker_probe"] and "--live" in test, name
        # The first check must not come before the models are loaded.
        assert duration_s(services[name]["healthcheck"]["start_period"]) >= 60, name
    assert "/api/v1/health" in " ".join(services["web"]["healthcheck"]["test"])


def test_web_and_workers_start_after_migrate_completed(services):
    assert services["migrate"]["command"] == ["python", "manage.py", "migrate", "--noinput"]
    for name in ["web", *workers(services).values()]:
        assert services[name]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}, name


def test_stop_grace_periods_let_the_drain_finish(services):
    for queue, name in workers(services).items():
        limit_s = settings.OFFLINE_TIME_LIMIT_S if queue == "offline" else settings.ONLINE_TIME_LIMIT_S
        assert duration_s(services[name]["stop_grace_period"]) >= limit_s + MARGIN_S, name
    web = services["web"]["command"]
    graceful_s = float(web[web.index("--timeout-graceful-shutdown") + 1])
    assert graceful_s >= settings.ONLINE_MAX_DEADLINE_MS / 1000
    assert duration_s(services["web"]["stop_grace_period"]) > graceful_s


def compose_client() -> list[str] | None:
    """`docker compose` (v2), else the older `docker-compose`, where one is installed."""
    for client in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(client[0]) is None:
            continue
        probe = subprocess.run([*client, "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return client
    return None


def test_docker_compose_accepts_the_file():
    client = compose_client()
    if client is None:
        pytest.skip("no docker compose client here; the file is checked as YAML above")
    env = {**os.environ, "DJANGO_SECRET_KEY": "x" * 50, "POSTGRES_PASSWORD": "pw", "FLOWER_BASIC_AUTH": "a:b"}
    result = subprocess.run([*client, "-f", str(COMPOSE), "config", "--quiet"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
