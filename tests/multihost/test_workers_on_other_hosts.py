"""Workers on other hosts (issue 11): the platform spread over network namespaces, driven over HTTP.

Host A runs Redis, PostgreSQL and web; host B an online worker for `identity`; host C an online worker
for `router` and the offline worker; host D frozen standbys for both (tests/multihost/conftest.py).
The tests run in order, each leaving the hosts as the next one expects: predictions across hosts, a
killed worker, an offline job, then SIGTERM on an online and on an offline worker, and last three users'
jobs shared fairly by offline workers on hosts C and D.
"""

from __future__ import annotations

import csv
import io
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import psycopg
import pytest
import requests

from inference.core.keys import backlog_key
from tests.conftest import wait_until
from tests.multihost.conftest import DISPATCHER_HEARTBEAT_S, JOB_CHUNK_ROWS, JOBS_PREFETCH_CHUNKS, Cluster

pytestmark = pytest.mark.multihost

TEXTS = ["I was charged twice for my subscription", "where is my parcel", "the app crashes at login"]
LABELS = {"billing", "shipping", "technical", "account", "sales"}


def answered_on(response: requests.Response) -> str:
    """The host whose worker child answered (worker ids are `hostname:pid`, shown to staff callers only:
    the cluster's test user is staff, tests/multihost/conftest.py)."""
    return response.json()["worker"].split(":")[0]


def test_each_model_is_answered_by_the_worker_of_its_own_host(cluster: Cluster):
    for _ in range(5):
        router = cluster.predict("router", TEXTS)
        assert router.status_code == 200, router.text
        assert answered_on(router) == cluster.c.hostname
        identity = cluster.predict("identity", TEXTS)
        assert identity.status_code == 200, identity.text
        assert answered_on(identity) == cluster.b.hostname
    assert {o["label"] for o in router.json()["outputs"]} <= LABELS
    assert [o["chars"] for o in identity.json()["outputs"]] == [len(t) for t in TEXTS]
    # Each worker consumes its own model's queue (online.<model>) and loaded that model only: no request
    # of the other model reached it (every answer above came from the right host, none was an error).
    online = cluster.children("online")
    assert [e["models"] for e in online if e["worker_id"].startswith(f"{cluster.b.hostname}:")] == [["identity"]]
    assert [e["models"] for e in online if e["worker_id"].startswith(f"{cluster.c.hostname}:")] == [["router"]]
    models = {m["name"]: m for m in cluster.get("/api/v1/models").json()["models"]}
    assert models["router"]["served"] and models["identity"]["served"]
    # Every process reached Redis and PostgreSQL over the bridge, from its own host's address.
    redis_peers = {c["addr"].rsplit(":", 1)[0] for c in cluster.redis.client_list()}
    assert {cluster.a.address, cluster.b.address, cluster.c.address} <= redis_peers
    assert redis_peers <= set(cluster.addresses())  # no loopback: every process came over the network
    # web (tokens, on host A) and the migration (host B); PostgreSQL listens on host A's address only.
    assert {cluster.a.address, cluster.b.address} <= cluster.database_clients() <= set(cluster.addresses())


def test_a_killed_worker_makes_its_model_refuse_at_once_while_the_other_model_serves(cluster: Cluster):
    identity = cluster.processes["online-identity-b"]
    os.killpg(identity.pid, signal.SIGKILL)  # host B's worker and its child, as if the host died
    killed_at = time.monotonic()
    identity.popen.wait(timeout=10)
    seen: list[requests.Response] = []

    def refused() -> bool:
        # A short deadline: requests admitted before the refusal starts wait 0.5 s at most (then 504).
        seen.append(cluster.predict("identity", TEXTS[:1], deadline_ms=500))
        assert seen[-1].status_code in (503, 504), seen[-1].text
        return seen[-1].json().get("code") == "no_worker"

    wait_until(refused, 10, "identity refused with no_worker", interval_s=0.05)
    seen_after_s, refusal = time.monotonic() - killed_at, seen[-1]
    assert seen_after_s < 3 * DISPATCHER_HEARTBEAT_S + 3.0, f"no_worker only after {seen_after_s:.1f} s"
    assert int(refusal.headers["Retry-After"]) >= 1
    for _ in range(5):
        router = cluster.predict("router", TEXTS)
        assert router.status_code == 200, router.text
        assert answered_on(router) == cluster.c.hostname
    models = {m["name"]: m for m in cluster.get("/api/v1/models").json()["models"]}
    assert not models["identity"]["served"] and models["router"]["served"]
    before = ", ".join(f"{r.status_code} {r.json().get('code')}" for r in seen[:-1])
    print(f"\nidentity: 503 no_worker {seen_after_s:.2f} s after its worker was killed (before it: {before})")


def make_csv(rows: int) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["key", "text"])
    for i in range(rows):
        writer.writerow([f"k{i}", f"{TEXTS[i % len(TEXTS)]} (row {i})"])
    return out.getvalue().encode()


def upload(cluster: Cluster, rows: int, token: str | None = None) -> dict:
    """A job of `rows` rows, created by the test user (or by the user of `token`)."""
    response = requests.post(
        f"{cluster.url}/api/v1/jobs",
        files={"file": ("rows.csv", make_csv(rows), "text/csv")},
        data={"text_column": "text", "id_column": "key", "model": "router"},
        headers=cluster.headers(token),
        timeout=60,
    )
    assert response.status_code == 202, response.text
    return response.json()


ENDED = {"succeeded", "partial", "failed", "cancelled"}


def job(cluster: Cluster, job_id: int, token: str | None = None) -> dict:
    return cluster.get(f"/api/v1/jobs/{job_id}", token=token).json()


def wait_for_end(cluster: Cluster, job_id: int, timeout_s: float = 90) -> dict:
    return wait_until(lambda: (j := job(cluster, job_id))["status"] in ENDED and j, timeout_s, f"job {job_id} to end")


def results(cluster: Cluster, job_id: int, token: str | None = None, **params) -> dict:
    return cluster.get(f"/api/v1/jobs/{job_id}/results", token=token, page_size=1000, **params).json()


def assert_every_row_done_once(cluster: Cluster, job_id: int, total: int, token: str | None = None) -> None:
    rows = results(cluster, job_id, token)["results"]
    assert sorted(r["index"] for r in rows) == list(range(total))
    assert {r["status"] for r in rows} == {"done"}
    assert {r["attempts"] for r in rows} == {1}, "a row was written more than once"
    assert {r["label"] for r in rows} <= LABELS


def test_an_offline_job_runs_to_completion_on_host_c(cluster: Cluster):
    created = upload(cluster, 60)  # read and run by host C's offline worker, the only one not frozen
    ended = wait_for_end(cluster, created["id"])
    assert (ended["status"], ended["done_rows"], ended["failed_rows"]) == ("succeeded", 60, 0), ended
    assert_every_row_done_once(cluster, created["id"], 60)
    assert cluster.c.address in cluster.database_clients()  # its rows were read and written from host C


def cpu_ticks(pid: int) -> int:
    """CPU time a process has used (user + system), in clock ticks, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_sigterm_drains_an_online_worker_and_another_host_answers_what_it_held(cluster: Cluster):
    """Warm shutdown, as the design promises (inference/tasks.py, AdaptiveBatches.hand_back): the batch a
    child is running is finished and answered; requests the dispatcher held but never started go back
    to the head of the model's queue, where another replica (host D, as in a rolling update) answers
    them within their deadline; nothing is lost, and what is sent once it is stopping is not served by it.
    The replica stays frozen until C's dispatcher holds every request, so that C, not D, takes them."""
    worker, replica = cluster.processes["online-router-c"], cluster.processes["online-router-d"]
    child = cluster.child_on(cluster.c, "online", "router", worker)["pid"]
    # 10 x 128 tokens: one dispatch, one pass, about half a second of CPU.
    long_texts = [f"{i} " + "please refund the duplicate charge on my invoice " * 30 for i in range(10)]

    def held(count: int) -> bool:
        return cluster.redis.zcard(backlog_key("router")) == count and cluster.redis.llen("online.router") == 0

    sent = 8
    with ThreadPoolExecutor(max_workers=sent + 3) as pool:
        try:
            idle = cpu_ticks(child)
            calls = [pool.submit(cluster.predict, "router", long_texts, deadline_ms=30000)]
            try:
                wait_until(lambda: cpu_ticks(child) - idle >= 3, 10, "C's child computing", interval_s=0.005)
                os.kill(child, signal.SIGSTOP)  # held in the middle of its pass: busy for as long as the test needs
                assert cluster.redis.zcard(backlog_key("router")) == 1, "the pass ended before the child was stopped"
                for i in range(1, sent):
                    calls.append(pool.submit(cluster.predict, "router", [f"held {i}"], deadline_ms=30000))
                wait_until(lambda: held(sent), 5, "C's dispatcher to hold the other requests (its child is busy)")
                cluster.thaw(replica)  # the other replica runs on, and takes what C gives back
                worker.popen.send_signal(signal.SIGTERM)  # to the main process, as an orchestrator stops a container
                wait_until(lambda: "Warm shutdown" in worker.tail(), 10, "the warm shutdown to start")
                late = [pool.submit(cluster.predict, "router", [f"late {i}"], deadline_ms=30000) for i in range(3)]
            finally:
                os.kill(child, signal.SIGCONT)
            assert worker.popen.wait(timeout=30) == 0, worker.tail()
            handed = int(re.search(r"handed (\d+) waiting online requests back", worker.tail()).group(1))
            # The held ones, and any late one that C's BRPOP, already waiting in Redis, took as it stopped.
            assert sent - 1 <= handed <= sent - 1 + len(late)
        finally:
            cluster.thaw(replica)
        answers = [call.result() for call in calls]
        late_answers = [call.result() for call in late]
    assert [r.status_code for r in answers] == [200] * sent, [r.text for r in answers]
    assert answered_on(answers[0]) == cluster.c.hostname  # finished by the stopping worker's child
    assert len(answers[0].json()["outputs"]) == len(long_texts)
    assert {answered_on(r) for r in answers[1:]} == {cluster.d.hostname}  # handed back, answered by the replica
    for response in late_answers:  # never served by the stopping worker: answered by the replica, or refused
        assert response.status_code in (200, 503), response.text
        if response.status_code == 200:
            assert answered_on(response) == cluster.d.hostname
        else:
            assert response.json()["code"] == "no_worker"
    late_seen = ", ".join(f"{r.status_code} {answered_on(r) if r.ok else r.json()['code']}" for r in late_answers)
    print(f"\nrouter: C finished its running pass and handed {handed} back; D answered them; late: {late_seen}")


def queued_messages(cluster: Cluster, lists: list) -> list[tuple[int, str]]:
    """(chunk id, delivery tag) of each offline message waiting in Redis: what a failure should name."""
    import base64
    import json

    found = []
    for key in lists:
        for raw in cluster.redis.lrange(key, 0, -1):
            message = json.loads(raw)
            body = json.loads(base64.b64decode(message["body"]))
            found.append((body[1].get("chunk_id"), message["properties"].get("delivery_tag", "")))
    return found


def chunk_states(cluster: Cluster, job_id: int) -> list[tuple]:
    with psycopg.connect(cluster.database_url, connect_timeout=5) as db:
        query = "SELECT id, status, dispatched_at IS NOT NULL FROM jobs_chunk WHERE job_id = %s ORDER BY id"
        return db.execute(query, [job_id]).fetchall()


def test_sigterm_mid_job_gives_the_offline_chunks_back_and_another_worker_finishes_the_job(cluster: Cluster):
    offline, standby = cluster.processes["offline-c"], cluster.processes["offline-d"]
    total = 300
    created = upload(cluster, total)
    wait_until(lambda: results(cluster, created["id"], status="done")["count"] > 0, 60, "the first rows done on C")
    offline.popen.send_signal(signal.SIGTERM)
    assert offline.popen.wait(timeout=60) == 0, offline.tail()
    # Warm shutdown: the batch its child held was finished, and none is left half-done. The chunks the
    # scheduler had sent ahead and no child had claimed wait in the queue as messages (the ones C had
    # prefetched were given back); the rest of the job waits in the database, unsent.
    with psycopg.connect(cluster.database_url, connect_timeout=5) as db:
        query = "SELECT status, count(*) FROM jobs_chunk WHERE job_id = %s GROUP BY status"
        chunks = dict(db.execute(query, [created["id"]]).fetchall())
        query = "SELECT count(*) FROM jobs_chunk WHERE job_id = %s AND status = 'queued' AND dispatched_at IS NOT NULL"
        sent = db.execute(query, [created["id"]]).fetchone()[0]
    done_rows = results(cluster, created["id"], status="done")["count"]
    assert 0 < done_rows < total, "SIGTERM came too late to stop the job midway"
    assert set(chunks) <= {"done", "queued"} and chunks["done"] * JOB_CHUNK_ROWS == done_rows, chunks
    # kombu keeps one list per queue (and per priority, named after it); nothing sits unacknowledged.
    lists = [k for k in cluster.redis.scan_iter("offline*") if cluster.redis.type(k) == "list"]
    messages = queued_messages(cluster, lists)
    waiting = len(messages)
    states = {chunk_id: status for chunk_id, status, _ in chunk_states(cluster, created["id"])}
    sent_ids = {
        chunk_id
        for chunk_id, status, dispatched in chunk_states(cluster, created["id"])
        if dispatched and status == "queued"
    }
    # Every chunk sent and not claimed has its message back in the queue, once, and nothing else waits there:
    # no copy of a chunk C ran. (A SIGTERM between a dispatch and its child's acceptance used to leave one:
    # the consumer's pool flush dropped the job, the child ran it anyway, and kombu restored its message;
    # AdaptiveBatches._settle_dropped acknowledges it now, and tests/jobs/test_shutdown_dropped_dispatch.py
    # makes that case on purpose.)
    assert sorted(chunk_id for chunk_id, _ in messages) == sorted(sent_ids), (messages, states)
    assert waiting == sent, f"{waiting} messages for {sent} chunks sent: {messages}"
    # Bounded by the prefetch, not by the job's backlog: C's child was the only live offline child (D's
    # has been frozen since the hosts came up).
    assert sent <= JOBS_PREFETCH_CHUNKS * 1 < chunks["queued"], f"{sent} of {chunks['queued']} queued chunks sent"
    assert not cluster.redis.hlen("unacked")
    assert job(cluster, created["id"])["status"] == "running"
    cluster.thaw(standby)  # another host's offline worker
    ended = wait_for_end(cluster, created["id"])
    assert (ended["status"], ended["done_rows"], ended["failed_rows"]) == ("succeeded", total, 0), ended
    assert_every_row_done_once(cluster, created["id"], total)
    print(
        f"\noffline: {done_rows} of {total} rows done on C at SIGTERM, {waiting} sent chunks back in the queue "
        f"({chunks['queued'] - sent} unsent in the database); D did the rest"
    )


def test_offline_workers_on_two_hosts_share_the_work_fairly_between_three_users(cluster: Cluster):
    """Issue 19: one user's big job is created first, then two other users' small jobs (a third of it
    each); the offline workers of hosts C and D, each pulling on its own, serve the three users in turn
    rather than in arrival order: every user's rows advance while all three jobs run, the small jobs end
    before the big one, and every row is done once.

    Last in the file: it starts a second offline worker on host C (the SIGTERM test stopped the first one)
    and leaves both running."""
    worker = cluster.worker(cluster.c, "offline-c2", "offline", models="router", prefetch=4)
    standby = cluster.processes["offline-d"]  # thawed by the SIGTERM test
    tokens = cluster.add_users(cluster.b, "second", "third")  # while C's worker loads its model
    tokens["tester"] = cluster.token
    cluster.wait_for_child(cluster.c, "offline", "router", worker)
    children = [
        cluster.child_on(host, "offline", "router", process)["pid"]
        for host, process in ((cluster.c, worker), (cluster.d, standby))
    ]
    busy_before = [cpu_ticks(pid) for pid in children]
    sizes = {"tester": 900, "second": 300, "third": 300}
    ids = {user: upload(cluster, rows, tokens[user])["id"] for user, rows in sizes.items()}  # the big one first
    samples: list[dict[str, dict]] = []

    def all_ended() -> bool:
        samples.append({user: job(cluster, ids[user], tokens[user]) for user in ids})
        return all(j["status"] in ENDED for j in samples[-1].values())

    wait_until(all_ended, 300, "the three users' jobs to end", interval_s=0.1)
    busy = [cpu_ticks(pid) - before for pid, before in zip(children, busy_before, strict=True)]
    ended = samples[-1]
    for user, rows in sizes.items():
        got = ended[user]
        assert (got["status"], got["done_rows"], got["failed_rows"]) == ("succeeded", rows, 0), got
        assert_every_row_done_once(cluster, ids[user], rows, tokens[user])
    # Served in turn, not in arrival order: both small jobs ended while the big one, created first, still ran.
    finished = {user: datetime.fromisoformat(ended[user]["finished_at"]) for user in ids}
    assert max(finished["second"], finished["third"]) < finished["tester"], finished
    # While all three ran (from the last one queued to the first one ending), each user's rows grew, by a
    # fair part of what all three did (a third each; half of that allowed for the chunks in flight).
    start = next(
        (i for i, s in enumerate(samples) if all(j["status"] in ("queued", "running") for j in s.values())), None
    )
    end = next(i for i, s in enumerate(samples) if any(j["status"] in ENDED for j in s.values()))
    assert start is not None and start < end, "one job ended before the last one was queued"
    grown = {user: samples[end][user]["done_rows"] - samples[start][user]["done_rows"] for user in ids}
    total = sum(grown.values())
    assert all(rows >= total / 6 for rows in grown.values()), f"rows done by each user while all three ran: {grown}"
    # Both hosts' offline children worked on them (at least a second of CPU each).
    assert min(busy) >= 100, f"CPU ticks of the offline children of C and D: {busy}"
    seconds = {user: (finished[user] - min(finished.values())).total_seconds() for user in ids}
    print(
        f"\nfair share: while all three ran, rows done {grown}; the jobs ended at {seconds} s "
        f"(relative to the first); CPU ticks C {busy[0]}, D {busy[1]}; {len(samples)} samples"
    )
