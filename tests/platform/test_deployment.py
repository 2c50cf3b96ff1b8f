"""Deployment defaults: the production profile passes `check --deploy`, and docker-compose ships no secrets."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys

import yaml

from tests.conftest import ROOT


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "METRICS_"))}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**base, "DJANGO_SETTINGS_MODULE": "platform_.settings.production", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_production_profile_passes_the_deploy_check():
    result = manage("check", "--deploy", "--fail-level", "WARNING", DJANGO_SECRET_KEY=secrets.token_urlsafe(50))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues (0 silenced)" in result.stdout


def test_production_switches_for_a_tls_proxy_are_deliberate_not_warnings():
    """A proxy that already redirects and sends HSTS: turning those off is a choice, and the check stays clean."""
    result = manage(
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        DJANGO_SECRET_KEY=secrets.token_urlsafe(50),
        DJANGO_BEHIND_TLS_PROXY="true",
        FORWARDED_ALLOW_IPS="10.0.0.0/8",
        DJANGO_SECURE_SSL_REDIRECT="false",
        DJANGO_SECURE_HSTS_SECONDS="0",
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_production_profile_refuses_to_start_without_a_secret_key():
    result = manage("check")
    assert result.returncode != 0 and "DJANGO_SECRET_KEY must be set" in result.stderr


def test_compose_has_no_default_secrets_and_keeps_flower_and_postgres_private():
    text = (ROOT / "docker-compose.yml").read_text()
    compose = yaml.safe_load(text)
    assert "change-me" not in text
    for name in ("DJANGO_SECRET_KEY", "POSTGRES_PASSWORD", "FLOWER_BASIC_AUTH"):
        # ${NAME:?message}: compose stops and prints the message when it is unset.
        assert re.search(r"\$\{" + name + r":\?[^}]*" + name, text), f"{name} is not required with a message"
        assert not re.search(r"\$\{" + name + r":-", text), f"{name} has a default"
    services = compose["services"]
    assert "ports" not in services["postgres"] and "ports" not in services["redis"]
    assert all(str(p).startswith("${FLOWER_BIND:-127.0.0.1}:") for p in services["flower"]["ports"])
    assert compose["x-app"]["environment"]["DJANGO_SETTINGS_MODULE"] == "platform_.settings.production"


def test_production_redirects_people_to_https_but_not_probes_or_prometheus():
    """Probes and Prometheus's scrapes come over plain HTTP from inside the network: a redirect to HTTPS
    on a pod's address would fail them."""
    script = (
        "from django.test import Client; c = Client();"
        "print([c.get(p).status_code for p in ('/metrics', '/api/v1/health', '/jobs/')])"
    )
    result = manage(
        "shell", "-c", script, DJANGO_SECRET_KEY=secrets.token_urlsafe(50), DJANGO_ALLOWED_HOSTS="testserver"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    metrics, health, page = eval(result.stdout.strip().splitlines()[-1])
    assert (metrics, health, page) == (401, 200, 301)


def test_a_tls_proxy_without_its_address_refuses_to_start():
    """X-Forwarded-Proto is believed only from FORWARDED_ALLOW_IPS (platform_/server.py), not from any
    client as Django's SECURE_PROXY_SSL_HEADER would: without the proxy's address, say so at start."""
    result = manage("check", DJANGO_SECRET_KEY=secrets.token_urlsafe(50), DJANGO_BEHIND_TLS_PROXY="true")
    assert result.returncode != 0 and "needs FORWARDED_ALLOW_IPS" in result.stderr
