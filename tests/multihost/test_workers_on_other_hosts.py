"""Workers on other hosts (issue 11): the platform spread over three network namespaces, driven over HTTP.

Host A runs Redis, PostgreSQL and web; host B an online worker for `router`; host C an online worker
for `identity` and the offline worker (tests/multihost/conftest.py). The tests run in order, each
leaving the hosts as the next one expects: predictions across hosts, a killed worker, an offline
job, then SIGTERM on an online and on an offline worker.
"""

from __future__ import annotations

import csv
import io
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
import requests

from inference.admission import backlog_key
from tests.conftest import wait_until
from tests.multihost.conftest import DISPATCHER_HEARTBEAT_S, Cluster
from tests.multihost.hosts import Host

pytestmark = pytest.mark.multihost

TEXTS = ["I was charged twice for my subscription", "where is my parcel", "the app crashes at login"]
LABELS = {"billing", "shipping", "technical", "account", "sales"}


def answered_on(response: requests.Response) -> str:
    """The host whose worker child answered (worker ids are `hostname:pid`)."""
    return response.json()["worker"].split(":")[0]


def test_each_model_is_answered_by_the_worker_of_its_own_host(cluster: Cluster):
    for _ in range(5):
        router = cluster.predict("router", TEXTS)
        assert router.status_code == 200, router.text
        assert answered_on(router) == cluster.b.hostname
        identity = cluster.predict("identity", TEXTS)
        assert identity.status_code == 200, identity.text
        assert answered_on(identity) == cluster.c.hostname
    assert [o["chars"] for o in identity.json()["outputs"]] == [len(t) for t in TEXTS]
    assert {o["label"] for o in router.json()["outputs"]} <= LABELS
    # Each worker consumes its own model's queue: it loaded that model only, and no request of the
    # other model ever reached it (each answer above came from the right host, none was an error).
    assert [e["models"] for e in cluster.children("online") if e["worker_id"].startswith("host-b:")] == [["router"]]
    assert [e["models"] for e in cluster.children("online") if e["worker_id"].startswith("host-c:")] == [["identity"]]
    models = {m["name"]: m for m in cluster.get("/api/v1/models").json()["models"]}
    assert models["router"]["served"] and models["identity"]["served"]
    # Every process reached Redis and PostgreSQL over the bridge, from its own host's address.
    redis_peers = {c["addr"].rsplit(":", 1)[0] for c in cluster.redis.client_list()}
    assert {cluster.a.address, cluster.b.address, cluster.c.address} <= redis_peers
    assert "127.0.0.1" not in redis_peers
    with psycopg.connect(cluster.database_url, connect_timeout=5) as db:
        rows = db.execute("SELECT DISTINCT host(client_addr) FROM pg_stat_activity WHERE datname = 'platform'")
        db_peers = {row[0] for row in rows}
    assert {cluster.a.address, cluster.c.address} <= db_peers  # web (tokens) and the offline worker


def test_a_killed_worker_makes_its_model_refuse_at_once_while_the_other_model_serves(cluster: Cluster):
    router = cluster.processes["online-router-b"]
    os.killpg(router.pid, signal.SIGKILL)  # host B's worker and its child, as if the host died
    killed_at = time.monotonic()
    router.popen.wait(timeout=10)

    seen: list[requests.Response] = []

    def refused() -> bool:
        # A short deadline: requests admitted before the refusal starts wait 0.5 s at most (then 504).
        seen.append(cluster.predict("router", TEXTS[:1], deadline_ms=500))
        assert seen[-1].status_code in (503, 504), seen[-1].text
        return seen[-1].json().get("code") == "no_worker"

    wait_until(refused, 10, "router refused with no_worker", interval_s=0.05)
    seen_after_s, refusal = time.monotonic() - killed_at, seen[-1]
    assert seen_after_s < 3 * DISPATCHER_HEARTBEAT_S + 2.0, f"no_worker only after {seen_after_s:.1f} s"
    assert int(refusal.headers["Retry-After"]) >= 1
    for _ in range(5):
        identity = cluster.predict("identity", TEXTS)
        assert identity.status_code == 200, identity.text
        assert answered_on(identity) == cluster.c.hostname
    models = {m["name"]: m for m in cluster.get("/api/v1/models").json()["models"]}
    assert not models["router"]["served"] and models["identity"]["served"]
    # A worker started again on host B serves the model again.
    again = cluster.worker(cluster.b, "online-router-b-again", "online.router")
    cluster.wait_for_child(cluster.b, "online", "router", again)
    back = wait_until(lambda: (r := cluster.predict("router", TEXTS)).status_code == 200 and r, 10, "router again")
    assert answered_on(back) == cluster.b.hostname
    before = ", ".join(f"{r.status_code} {r.json().get('code')}" for r in seen[:-1])
    print(f"\nrouter: 503 no_worker {seen_after_s:.2f} s after its worker was killed (before it: {before})")


def make_csv(rows: int) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["key", "text"])
    for i in range(rows):
        writer.writerow([f"k{i}", f"{TEXTS[i % len(TEXTS)]} (row {i})"])
    return out.getvalue().encode()


def upload(cluster: Cluster, rows: int) -> dict:
    response = requests.post(
        f"{cluster.url}/api/v1/jobs",
        files={"file": ("rows.csv", make_csv(rows), "text/csv")},
        data={"text_column": "text", "id_column": "key", "model": "router"},
        headers=cluster.headers(),
        timeout=60,
    )
    assert response.status_code == 202, response.text
    return response.json()


def job(cluster: Cluster, job_id: int) -> dict:
    return cluster.get(f"/api/v1/jobs/{job_id}").json()


def wait_for_end(cluster: Cluster, job_id: int, timeout_s: float = 90) -> dict:
    ended = {"succeeded", "partial", "failed", "cancelled"}
    return wait_until(lambda: (j := job(cluster, job_id))["status"] in ended and j, timeout_s, f"job {job_id} to end")


def results(cluster: Cluster, job_id: int, **params) -> dict:
    return cluster.get(f"/api/v1/jobs/{job_id}/results", page_size=1000, **params).json()


def assert_every_row_done_once(cluster: Cluster, job_id: int, total: int) -> None:
    rows = results(cluster, job_id)["results"]
    assert sorted(r["index"] for r in rows) == list(range(total))
    assert {r["status"] for r in rows} == {"done"}
    assert {r["attempts"] for r in rows} == {1}, "a row was written more than once"
    assert {r["label"] for r in rows} <= LABELS


def test_an_offline_job_runs_to_completion_on_host_c(cluster: Cluster):
    created = upload(cluster, 60)
    ended = wait_for_end(cluster, created["id"])
    assert (ended["status"], ended["done_rows"], ended["failed_rows"]) == ("succeeded", 60, 0), ended
    assert_every_row_done_once(cluster, created["id"], 60)


def cpu_ticks(pid: int) -> int:
    """CPU time a process has used (user + system), in clock ticks, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def blocked_clients(cluster: Cluster, host: Host) -> list[dict]:
    """Redis connections from `host` blocked in a command (a worker's BRPOP waiting for a message)."""
    return [c for c in cluster.redis.client_list() if c["addr"].startswith(f"{host.address}:") and "b" in c["flags"]]


def test_sigterm_drains_an_online_worker_and_another_host_answers_what_it_held(cluster: Cluster):
    """Warm shutdown, as the design promises (inference/tasks.py, AdaptiveBatches.hand_back): the batch a
    child is running is finished and answered; requests the dispatcher held but never started go back
    to the head of the model's queue, where another replica (host D, as in a rolling update) answers
    them within their deadline; nothing is lost, and what is sent once it is stopping is not served by it."""
    worker = cluster.running("online-router-b")
    child = cluster.child_on(cluster.b, "online", "router", worker)["pid"]
    d = cluster.network.hosts["d"]
    replica = cluster.worker(d, "online-router-d", "online.router")
    cluster.wait_for_child(d, "online", "router", replica)
    # 10 x 128 tokens: one dispatch, one pass, about half a second of CPU.
    long_texts = [f"{i} " + "please refund the duplicate charge on my invoice " * 30 for i in range(10)]

    def held(count: int) -> bool:
        return cluster.redis.zcard(backlog_key("router")) == count and cluster.redis.llen("online.router") == 0

    sent = 8
    with ThreadPoolExecutor(max_workers=sent + 3) as pool:
        os.killpg(replica.pid, signal.SIGSTOP)  # the replica takes nothing until B has stopped...
        try:
            # ...once its last BRPOP has expired in Redis (kombu's is 1 s): then every request goes to B.
            wait_until(lambda: not blocked_clients(cluster, d), 5, "host D's BRPOP to expire")
            idle = cpu_ticks(child)
            calls = [pool.submit(cluster.predict, "router", long_texts, deadline_ms=30000)]
            try:
                wait_until(lambda: cpu_ticks(child) - idle >= 3, 10, "B's child computing", interval_s=0.005)
                os.kill(child, signal.SIGSTOP)  # held in the middle of its pass: busy for as long as the test needs
                calls += [
                    pool.submit(cluster.predict, "router", [f"held {i}"], deadline_ms=30000) for i in range(1, sent)
                ]
                wait_until(lambda: held(sent), 5, "B's dispatcher to hold the other requests (its child is busy)")
                worker.popen.send_signal(signal.SIGTERM)  # to the main process, as an orchestrator stops a container
                wait_until(lambda: "Warm shutdown" in worker.tail(), 10, "the warm shutdown to start")
                late = [pool.submit(cluster.predict, "router", [f"late {i}"], deadline_ms=30000) for i in range(3)]
            finally:
                os.kill(child, signal.SIGCONT)
            assert worker.popen.wait(timeout=30) == 0, worker.tail()
            handed = int(re.search(r"handed (\d+) waiting online requests back", worker.tail()).group(1))
            # The held ones, and any late one that B's BRPOP, already waiting in Redis, took as it stopped.
            assert sent - 1 <= handed <= sent - 1 + len(late)
            assert cluster.redis.llen("online.router") >= handed  # back in Redis, none lost with the worker
        finally:
            os.killpg(replica.pid, signal.SIGCONT)
        answers = [call.result() for call in calls]
        late_answers = [call.result() for call in late]
    assert [r.status_code for r in answers] == [200] * sent, [r.text for r in answers]
    assert answered_on(answers[0]) == cluster.b.hostname  # finished by the stopping worker's child
    assert len(answers[0].json()["outputs"]) == len(long_texts)
    assert {answered_on(r) for r in answers[1:]} == {d.hostname}  # handed back, answered by the replica
    for response in late_answers:  # never served by the stopping worker: answered by the replica, or refused
        assert response.status_code in (200, 503), response.text
        if response.status_code == 200:
            assert answered_on(response) == d.hostname
        else:
            assert response.json()["code"] == "no_worker"
    assert replica.popen.poll() is None


def test_sigterm_mid_job_gives_the_offline_chunks_back_and_another_worker_finishes_the_job(cluster: Cluster):
    offline = cluster.processes["offline-c"]
    total = 300
    created = upload(cluster, total)
    wait_until(lambda: results(cluster, created["id"], status="done")["count"] > 0, 60, "the first rows done on host C")
    offline.popen.send_signal(signal.SIGTERM)
    assert offline.popen.wait(timeout=60) == 0, offline.tail()
    # Warm shutdown: the batch its child held was finished; every other chunk waits in the queue,
    # as a message (the ones it had prefetched were given back), and none is left half-done.
    with psycopg.connect(cluster.database_url, connect_timeout=5) as db:
        chunks = dict(
            db.execute("SELECT status, count(*) FROM jobs_chunk WHERE job_id = %s GROUP BY status", [created["id"]])
        )
    done_rows = results(cluster, created["id"], status="done")["count"]
    assert 0 < done_rows < total, "SIGTERM came too late to stop the job midway"
    assert set(chunks) <= {"done", "queued"} and chunks["done"] * 20 == done_rows, chunks
    # kombu keeps one list per queue (and per priority, named after it); nothing sits unacknowledged.
    lists = [k for k in cluster.redis.scan_iter("offline*") if cluster.redis.type(k) == "list"]
    waiting = sum(cluster.redis.llen(key) for key in lists)
    assert not cluster.redis.hlen("unacked")
    assert waiting == chunks["queued"], f"{waiting} messages for {chunks['queued']} queued chunks"
    assert job(cluster, created["id"])["status"] == "running"
    cluster.worker(cluster.b, "offline-b", "offline", models="router", prefetch=4)
    ended = wait_for_end(cluster, created["id"])
    assert (ended["status"], ended["done_rows"], ended["failed_rows"]) == ("succeeded", total, 0), ended
    assert_every_row_done_once(cluster, created["id"], total)
