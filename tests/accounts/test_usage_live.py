"""Metering on the live stack: a key's predict and embeddings calls and its user's job rows show in
GET /api/v1/usage (per key and model) once the counters are rolled up, and /metrics per model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests

from tests.accounts.test_keys_live import _embeddings, _make_key, _predict, owner  # noqa: F401  (fixture)
from tests.conftest import wait_until

pytestmark = pytest.mark.integration


def _flush(stack) -> None:
    """Roll the counters up now, as the workers' housekeeping does every USAGE_FLUSH_S."""
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", "from accounts import usage; usage.flush()"],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_keys_calls_and_its_users_job_rows_show_in_usage_and_metrics(stack, owner):  # noqa: F811
    _, session = owner
    key = _make_key(stack, session, name="metered")
    for _ in range(2):
        assert _predict(stack, key["key"]).status_code == 200
    assert _embeddings(stack, key["key"]).status_code == 200
    assert _predict(stack, key["key"], model="no-such-model").status_code == 404  # refused: not usage
    auth = {"Authorization": f"Bearer {key['key']}"}
    job = requests.post(
        f"{stack.url}/api/v1/jobs",
        files={"file": ("a.csv", b"text\nhello\nworld\nagain\n")},
        data={"text_column": "text", "model": "router"},
        headers=auth,
        timeout=10,
    )
    assert job.status_code == 202, job.text
    wait_until(
        lambda: (
            requests.get(f"{stack.url}/api/v1/jobs/{job.json()['id']}", headers=auth, timeout=10).json()["status"]
            == "succeeded"
        ),
        120,
        "the job to succeed",
    )

    def rolled_up() -> dict | None:
        # The web process writes its sums every USAGE_WRITE_S (1 s); the workers roll them up every minute.
        _flush(stack)
        body = requests.get(f"{stack.url}/api/v1/usage", headers=auth, timeout=10).json()
        return body if body["totals"]["requests"] == 3 else None

    body = wait_until(rolled_up, 20, "the usage to be rolled up")
    by = {(row["model"], row["key_prefix"]): row for row in body["rows"]}
    router = by["router", key["prefix"]]
    assert (router["requests"], router["inputs"]) == (2, 2) and router["tokens"] > 0
    assert by["embedding", key["prefix"]]["requests"] == 1
    assert router["job_rows"] == 3  # the job was made with the key: its rows are the key's
    assert body["totals"]["requests"] == 3
    metrics = requests.get(
        f"{stack.url}/metrics", headers={"Authorization": "Bearer test-metrics-token"}, timeout=10
    ).text
    assert 'platform_usage_tokens_total{model="router"}' in metrics
    assert key["prefix"] not in metrics
