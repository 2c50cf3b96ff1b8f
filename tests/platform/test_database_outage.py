"""PostgreSQL going away under a running job and coming back (issue 22, item 5).

A private PostgreSQL cluster (initdb, as the `postgres` user: PostgreSQL refuses to run as root) serves a
web process and an offline worker of their own; the shared test database is never touched. While a job
runs, the cluster stops: every API path answers a JSON 503 (`database_unavailable`) or still answers
from what needs no database, never a 500 nor a plain-text error; pages answer the styled 503. When the
cluster is back the job finishes, every row exactly once, without restarting anything.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.conftest import ROOT, TESTER_PASSWORD, _start, _stop, free_port, wait_until
from tests.jobs.test_jobs_api import assert_each_row_once, export_rows, make_csv, upload, wait_for_end

pytestmark = pytest.mark.integration

PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)), None)
ROWS = 600  # 12 chunks of JOBS_CHUNK_ROWS=50: still running when the database stops


@dataclass
class Cluster:
    data: Path
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/platform"

    def ctl(self, *args: str) -> None:
        command = [str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", *args]
        subprocess.run(["runuser", "-u", "postgres", "--", *command], check=True, capture_output=True)

    def start(self) -> None:
        self.ctl("-o", f"-p {self.port} -k {self.data} -h 127.0.0.1", "start")

    def stop(self) -> None:
        self.ctl("-m", "fast", "stop")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if PG_BIN is None or shutil.which("runuser") is None:
        pytest.skip("PostgreSQL's server binaries (initdb, pg_ctl) or runuser are not installed")
    # Not under pytest's temp folder: the postgres user cannot traverse root's 0700 /tmp/pytest-of-root.
    root = Path(tempfile.mkdtemp(prefix="platform-pg-"))
    data = root / "data"
    data.mkdir()
    shutil.chown(root, "postgres")
    shutil.chown(data, "postgres")
    subprocess.run(
        ["runuser", "-u", "postgres", "--", str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
        check=True,
        capture_output=True,
    )
    running = Cluster(data=data, port=free_port(), log=root / "postgres.log")
    shutil.chown(root, "postgres")
    running.log.touch()
    shutil.chown(running.log, "postgres")
    running.start()
    subprocess.run(
        [str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(running.port), "-U", "postgres", "platform"],
        check=True,
        capture_output=True,
    )
    yield running
    try:
        running.stop()
    except subprocess.CalledProcessError:
        pass
    shutil.rmtree(root, ignore_errors=True)


@dataclass
class Platform:
    url: str
    token: str
    web: subprocess.Popen
    offline: subprocess.Popen
    logs: Path

    def log_tail(self, name: str = "web") -> str:
        return (self.logs / f"{name}.log").read_text()[-20000:]

    def headers(self, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Token {self.token}", **extra}


@pytest.fixture(scope="module")
def platform(stack, cluster, tmp_path_factory) -> Iterator[Platform]:
    """A web process and an offline worker on the private cluster (the shared stack's Redis and models)."""
    port = free_port()
    env = {**stack.env, "DATABASE_URL": cluster.url, "WEB_DB_POOL_TIMEOUT_S": "2"}
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "-v", "0"], env=env, cwd=ROOT, check=True, capture_output=True)
    make_user = (
        "from django.contrib.auth import get_user_model; from rest_framework.authtoken.models import Token; "
        "u, _ = get_user_model().objects.get_or_create(username='outage'); "
        f"u.set_password('{TESTER_PASSWORD}'); u.is_staff = True; u.is_superuser = True; u.save(); "
        "print(Token.objects.get_or_create(user=u)[0].key)"
    )
    made = subprocess.run([*manage, "shell", "-c", make_user], env=env, cwd=ROOT, check=True, capture_output=True)
    token = made.stdout.decode().strip().splitlines()[-1]
    logs = tmp_path_factory.mktemp("outage-logs")
    bin_dir = Path(sys.executable).parent
    offline = _start(
        [str(bin_dir / "celery"), "-A", "platform_", "worker", "-Q", "offline", "-c", "1", "-P", "prefork"]
        + ["--prefetch-multiplier", "4", "--without-gossip", "--without-mingle", "-n", f"outage-{port}@%h"],
        {**env, "WORKER_QUEUE": "offline", "WORKER_MODELS": "router"},
        logs / "offline.log",
    )
    web = _start(
        [sys.executable, "-m", "platform_.server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env,
        logs / "web.log",
    )
    running = Platform(url=f"http://127.0.0.1:{port}", token=token, web=web, offline=offline, logs=logs)

    def ready() -> bool:
        for proc, name in ((web, "web"), (offline, "offline")):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited early:\n{(logs / f'{name}.log').read_text()[-4000:]}")
        try:
            return requests.get(f"{running.url}/api/v1/ready", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    wait_until(ready, 180, "the web process on the private cluster")
    yield running
    for proc in (web, offline):
        _stop(proc)


def api_paths(platform: Platform, job_id: int) -> list[str]:
    """Every GET path of the API's schema, its parameters filled with things that exist."""
    schema = requests.get(
        f"{platform.url}/api/schema/", params={"format": "json"}, headers=platform.headers(), timeout=30
    )
    assert schema.status_code == 200, schema.text[:300]
    fill = {"id": str(job_id), "pk": str(job_id), "model": "router", "name": "router", "batch_id": "batch_0"}
    paths = []
    for path, operations in json.loads(schema.text)["paths"].items():
        if "get" not in operations:
            continue
        for name, value in fill.items():
            path = path.replace("{" + name + "}", value)
        if "{" not in path:
            paths.append(path)
    return paths


def test_postgresql_down_answers_503_everywhere_and_the_job_resumes_when_it_is_back(platform, cluster):
    session = requests.Session()
    login = f"{platform.url}/accounts/login/"
    session.get(login, timeout=10)
    session.post(
        login,
        data={"username": "outage", "password": TESTER_PASSWORD, "csrfmiddlewaretoken": session.cookies["csrftoken"]},
        headers={"Referer": login},
        timeout=10,
    )
    assert "sessionid" in session.cookies
    created = upload(platform, make_csv(ROWS))
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    paths = api_paths(platform, job_id)
    assert f"/api/v1/jobs/{job_id}" in paths and "/api/v1/jobs" in paths

    def some_rows_done() -> bool:
        return (
            requests.get(f"{platform.url}/api/v1/jobs/{job_id}", headers=platform.headers(), timeout=10).json()[
                "done_rows"
            ]
            > 0
        )

    wait_until(some_rows_done, 120, "the job to start")
    cluster.stop()
    try:
        refused = []
        for path in paths:
            answer = requests.get(f"{platform.url}{path}", headers=platform.headers(), timeout=30)
            assert answer.status_code != 500 and answer.status_code < 600, (path, answer.status_code, answer.text[:200])
            if answer.status_code >= 500:
                assert answer.headers["Content-Type"].startswith("application/json"), (path, answer.text[:200])
                body = answer.json()
                code = body.get("code") or body.get("error", {}).get("code")
                assert (answer.status_code, code) == (503, "database_unavailable"), (path, body)
                assert int(answer.headers["Retry-After"]) > 0
                refused.append(path)
        # What needs the database says so; liveness needs none.
        assert f"/api/v1/jobs/{job_id}" in refused and "/api/v1/jobs" in refused, refused
        upload_while_down = upload(platform, make_csv(10))
        assert upload_while_down.status_code == 503, (upload_while_down.text[:300], platform.log_tail())
        assert upload_while_down.json()["code"] == "database_unavailable"
        # The upload page's POST is checked for its session before the body is read: the styled 503 too.
        page_upload = session.post(f"{platform.url}/jobs/", files={"file": ("t.csv", b"text\nhi\n")}, timeout=30)
        assert page_upload.status_code == 503 and "database is busy or unreachable" in page_upload.text
        for page in ("/jobs/", f"/jobs/{job_id}/", "/dashboard/"):
            answer = session.get(f"{platform.url}{page}", timeout=30)
            assert answer.status_code == 503, (page, answer.status_code)
            assert answer.headers["Content-Type"].startswith("text/html")
            assert "database is busy or unreachable" in answer.text and "product.css" in answer.text
    finally:
        cluster.start()

    # Back: the web's pool reconnects by itself (nothing restarted) and the job runs on to its end, every
    # row exactly once.
    def answers() -> bool:
        url = f"{platform.url}/api/v1/jobs/{job_id}"
        return requests.get(url, headers=platform.headers(), timeout=10).status_code == 200

    wait_until(answers, 30, "the API to answer again once PostgreSQL is back")
    job = wait_for_end(platform, job_id, timeout_s=180)
    assert (job["status"], job["done_rows"], job["failed_rows"]) == ("succeeded", ROWS, 0), job
    assert_each_row_once(export_rows(platform, job_id), ROWS)
    assert platform.web.poll() is None and platform.offline.poll() is None
    assert os.path.exists(cluster.data)
