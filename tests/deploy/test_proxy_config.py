"""The proxy's configuration as shipped: deploy/nginx (docker compose's `proxy`) and the Ingress for
ingress-nginx (deploy/kubernetes) apply the same limits, match the web's own body limits and upload paths,
and nginx itself accepts the file (`nginx -t`, where Debian's nginx is installed). tests/proxy runs it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from django.conf import settings

from benchmarks import nginx_front
from platform_.bodies import UPLOAD_ENDPOINTS
from tests.conftest import ROOT

TEMPLATE = ROOT / "deploy" / "nginx" / "templates" / "platform.conf.template"
ANNOTATION = "nginx.ingress.kubernetes.io/"


def mib(size: str) -> float:
    """nginx's size syntax (1m, 512k, 4096) in MiB."""
    number, unit = re.fullmatch(r"(\d+)([kKmMgG]?)", size).groups()
    return int(number) / {"": 1 << 20, "k": 1 << 10, "m": 1, "g": 1 / 1024}[unit.lower()]


def compose_defaults() -> dict[str, str]:
    """The proxy's NGINX_* values in docker-compose.yml when the environment sets none."""
    environment = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["proxy"]["environment"]
    return {k: re.sub(r"^\$\{\w+:-(.*)\}$", r"\1", str(v)) for k, v in environment.items()}


def test_compose_sets_every_variable_of_the_template_with_the_defaults_the_tests_run():
    used = set(re.findall(r"\$\{(NGINX_\w+)\}", TEMPLATE.read_text()))
    defaults = compose_defaults()
    assert used == set(defaults), "the template and docker-compose.yml's proxy name different NGINX_* variables"
    assert defaults == nginx_front.DEFAULTS | {"NGINX_UPSTREAM": "web:8000"}


def test_body_limits_match_the_webs_own():
    defaults = compose_defaults()
    # Uploads: the file limit plus the 1 MiB of multipart form the web allows around it (platform_/bodies.py).
    assert mib(defaults["NGINX_UPLOAD_MAX_BODY"]) == settings.JOBS_MAX_UPLOAD_BYTES / (1 << 20) + 1
    assert mib(defaults["NGINX_MAX_BODY"]) == settings.DATA_UPLOAD_MAX_MEMORY_SIZE / (1 << 20)
    assert mib(defaults["NGINX_PREDICT_MAX_BODY"]) < mib(defaults["NGINX_MAX_BODY"])
    template = TEMPLATE.read_text()
    for path in UPLOAD_ENDPOINTS:
        location = re.search(r"location = " + re.escape(path) + r" \{\n(.*?)\n    \}", template, re.S)
        assert location, f"no upload location for {path}"
        assert "client_max_body_size ${NGINX_UPLOAD_MAX_BODY};" in location.group(1), path


def test_forwarded_headers_are_set_by_the_proxy_not_passed_along():
    template = TEMPLATE.read_text()
    assert "proxy_set_header X-Forwarded-For $remote_addr;" in template
    assert "$proxy_add_x_forwarded_for" not in template  # would append to the client's own claim
    assert "proxy_set_header X-Forwarded-Proto $scheme;" in template


def test_nginx_accepts_the_shipped_configuration(tmp_path: Path):
    if not nginx_front.NGINX_BINARY.exists():
        pytest.skip("nginx is not installed (/usr/sbin/nginx): apt-get install nginx (.ci/run installs it)")
    values = {**nginx_front.DEFAULTS, "NGINX_UPSTREAM": "127.0.0.1:9", "NGINX_PORT": "18999"}
    conf = nginx_front.render(tmp_path, values)
    result = subprocess.run(
        [str(nginx_front.NGINX_BINARY), "-t", "-p", str(tmp_path), "-c", str(conf)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def ingresses() -> dict[str, dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the manifests cannot be rendered here (CI installs kubectl)")
    result = subprocess.run(
        [kubectl, "kustomize", "deploy/kubernetes/base"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    objects = [o for o in yaml.safe_load_all(result.stdout) if o]
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "Ingress"}


def test_the_ingress_applies_the_proxys_limits_with_the_same_body_limit_per_path():
    defaults = compose_defaults()
    by_name = ingresses()
    assert set(by_name) == {"web", "web-predict", "web-uploads"}
    paths: dict[str, str] = {}
    for name, ingress in by_name.items():
        notes = {k.removeprefix(ANNOTATION): v for k, v in ingress["metadata"]["annotations"].items()}
        assert notes["limit-connections"] == defaults["NGINX_CONNECTIONS_PER_ADDRESS"], name
        assert notes["limit-rps"] == defaults["NGINX_REQUESTS_PER_S"], name
        burst = int(notes["limit-rps"]) * int(notes["limit-burst-multiplier"])
        assert burst == int(defaults["NGINX_REQUEST_BURST"]), name
        assert notes["proxy-request-buffering"] == "on", name
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"] == {"name": "web", "port": {"name": "http"}}, name
                paths[path["path"]] = notes["proxy-body-size"]
    assert paths["/"] == defaults["NGINX_MAX_BODY"]
    assert paths["/api/v1/models/"] == paths["/v1/embeddings"] == defaults["NGINX_PREDICT_MAX_BODY"]
    assert {p: paths[p] for p in UPLOAD_ENDPOINTS} == dict.fromkeys(UPLOAD_ENDPOINTS, defaults["NGINX_UPLOAD_MAX_BODY"])


def test_the_controllers_settings_answer_429_and_replace_forwarded_headers():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(
        [kubectl, "kustomize", "deploy/kubernetes/ingress-nginx"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    (configmap,) = [o for o in yaml.safe_load_all(result.stdout) if o]
    data = configmap["data"]
    assert data["limit-conn-status-code"] == data["limit-req-status-code"] == "429"
    assert data["use-forwarded-headers"] == "false" and data["compute-full-forwarded-for"] == "false"
    assert data["client-header-timeout"] == compose_defaults()["NGINX_HEADER_TIMEOUT"].removesuffix("s")
    assert data["client-body-timeout"] == compose_defaults()["NGINX_BODY_TIMEOUT"].removesuffix("s")
    # Below uvicorn's keep-alive timeout (5 s), as in the template.
    assert int(data["upstream-keepalive-timeout"]) < 5
