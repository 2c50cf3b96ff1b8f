"""Fair offline scheduling on the live stack: users, priorities, quotas, and faults with several users' jobs.

The stack (tests/conftest.py) runs ONE offline worker with one child, 50-row chunks and
JOBS_PREFETCH_CHUNKS at its default of 1, so the broker holds about one chunk ahead of the child and
the rest wait in the database for the scheduler (jobs/scheduler.py) to pick them. The tests show
fairness without depending on speed: the big jobs have thousands of rows (JOBS_MAX_ROWS is 5,000),
and what is asserted is who ends first and how many of the big job's rows ran meanwhile (counted in
chunks, which the policy decides), never seconds.

Users: "tester" (stack.token), "other" (stack.other_token), "third" (stack.third_token). Every job a
test uploads is cancelled when it ends, and every UserShare it writes is deleted, since the other job
tests share these users.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from tests.conftest import JOBS_ENV, wait_until
from tests.jobs.test_jobs_api import make_csv

pytestmark = pytest.mark.integration

ENDED = {"succeeded", "partial", "failed", "cancelled"}
CHUNK_ROWS = int(JOBS_ENV["JOBS_CHUNK_ROWS"])
BIG_ROWS = int(JOBS_ENV["JOBS_MAX_ROWS"])
# chunks_ahead counts chunks still waiting in the database; at most this many more are already sent
# (JOBS_PREFETCH_CHUNKS, default 1, per live offline child: the stack has one, two in the SIGTERM test).
SENT_AHEAD_BOUND = 2


@dataclass
class User:
    """An API client as one of the stack's users; remembers what it uploaded."""

    stack: object
    name: str
    token: str
    uploaded: list[int] = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Token {self.token}"}

    def upload(self, rows: int, **fields) -> requests.Response:
        form = {"text_column": "text", "id_column": "key", "model": "router", **fields}
        response = requests.post(
            f"{self.stack.url}/api/v1/jobs",
            files={"file": (f"{self.name}-{rows}.csv", make_csv(rows), "text/csv")},
            data=form,
            headers=self.headers,
            timeout=60,
        )
        if response.status_code == 202:
            self.uploaded.append(response.json()["id"])
        return response

    def start(self, rows: int, **fields) -> int:
        """Upload a job that must be accepted; its id."""
        response = self.upload(rows, **fields)
        assert response.status_code == 202, response.text
        return response.json()["id"]

    def job(self, job_id: int) -> dict:
        response = requests.get(f"{self.stack.url}/api/v1/jobs/{job_id}", headers=self.headers, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()

    def cancel(self, job_id: int) -> None:
        requests.post(f"{self.stack.url}/api/v1/jobs/{job_id}/cancel", headers=self.headers, timeout=10)

    def wait_for_end(self, job_id: int, timeout_s: float = 240) -> dict:
        return wait_until(
            lambda: (job := self.job(job_id))["status"] in ENDED and job,
            timeout_s,
            f"{self.name}'s job {job_id} to end",
        )

    def wait_for_rows(self, job_id: int, rows: int, timeout_s: float = 120) -> dict:
        return wait_until(
            lambda: (job := self.job(job_id))["done_rows"] >= rows and job,
            timeout_s,
            f"{self.name}'s job {job_id} to have {rows} rows done",
        )

    def export(self, job_id: int) -> list[dict]:
        url = f"{self.stack.url}/api/v1/jobs/{job_id}/results.csv"
        response = requests.get(url, headers=self.headers, timeout=60)
        assert response.status_code == 200, response.text
        return list(csv.DictReader(io.StringIO(response.text)))

    def assert_every_row_done_once(self, job_id: int, total: int) -> None:
        job = self.job(job_id)
        assert (job["status"], job["done_rows"], job["failed_rows"]) == ("succeeded", total, 0), job
        rows = self.export(job_id)
        assert sorted(int(r["index"]) for r in rows) == list(range(total)), "every row exactly once in the export"
        assert all(r["status"] == "done" and r["label"] for r in rows)


def live_jobs(django_db_blocker) -> list[str]:
    from jobs.models import TERMINAL, Job

    with django_db_blocker.unblock():
        return [str(job) for job in Job.objects.exclude(status__in=TERMINAL)]


@pytest.fixture
def users(stack, django_db_blocker) -> Iterator[dict[str, User]]:
    """The three users, on an offline pool with no other live job (fairness is measured between ours);
    every job they upload is cancelled afterwards (a no-op for those that ended)."""
    wait_until(lambda: not live_jobs(django_db_blocker), 300, "other tests' offline jobs to end")
    made = {
        "tester": User(stack, "tester", stack.token),
        "other": User(stack, "other", stack.other_token),
        "third": User(stack, "third", stack.third_token),
    }
    yield made
    for user in made.values():
        for job_id in user.uploaded:
            user.cancel(job_id)


@pytest.fixture
def shares(django_db_blocker) -> Iterator:
    """set(username, **fields): what staff do in the admin (a UserShare row); the rows are deleted afterwards."""
    from django.contrib.auth import get_user_model

    from jobs.models import UserShare

    touched: list[str] = []

    def set_share(username: str, **fields) -> None:
        with django_db_blocker.unblock():
            user = get_user_model().objects.get(username=username)
            UserShare.objects.update_or_create(user=user, defaults=fields)
        touched.append(username)

    yield set_share
    with django_db_blocker.unblock():
        UserShare.objects.filter(user__username__in=touched).delete()


def remaining(job: dict) -> int:
    return job["total_rows"] - job["done_rows"] - job["failed_rows"]


# Two users ------------------------------------------------------------------------------------------


def test_a_small_job_uploaded_beside_a_big_one_of_another_user_ends_while_the_big_one_runs(users):
    a, b = users["tester"], users["other"]
    big = a.start(BIG_ROWS)
    a.wait_for_rows(big, 2 * CHUNK_ROWS)
    big_at_upload = a.job(big)
    small = b.start(20)
    seen: list[dict] = []

    def small_ended() -> dict | None:
        job = b.job(small)
        seen.append(job)
        return job if job["status"] in ENDED else None

    ended = wait_until(small_ended, 120, "the small job to end", interval_s=0.05)
    big_at_end = a.job(big)
    assert (ended["status"], ended["done_rows"]) == ("succeeded", 20), ended
    assert big_at_end["status"] == "running", "the small job waited for the whole big job"
    ran_meanwhile = big_at_end["done_rows"] - big_at_upload["done_rows"]
    # In arrival order the small job would wait for every chunk of the big one (thousands of rows);
    # in fair share it waits for the chunk in the child, the one sent ahead, and its own ingest's turn.
    assert ran_meanwhile <= 10 * CHUNK_ROWS, f"{ran_meanwhile} of the big job's rows ran before the small job ended"
    assert remaining(big_at_end) >= BIG_ROWS / 2, big_at_end
    waiting = [job for job in seen if job["status"] in ("queued", "running")]
    assert waiting, "the small job was never seen queued or running"
    for job in waiting:
        # Where it stands is bounded by what is already sent, not by the big job's backlog.
        assert job["chunks_ahead"] is not None and job["chunks_ahead"] <= SENT_AHEAD_BOUND, job
        assert job["rows_ahead"] is not None and job["rows_ahead"] <= SENT_AHEAD_BOUND * CHUNK_ROWS, job
        assert "higher priority" not in job["waiting_reason"], job
    print(
        f"\nsmall job: ended after {ran_meanwhile} of the big job's rows; the big job had {remaining(big_at_end)} left;"
        f" seen waiting with chunks_ahead {sorted({j['chunks_ahead'] for j in waiting})}"
    )


# Priorities -----------------------------------------------------------------------------------------


def test_asking_for_a_priority_above_ones_right_is_a_400_naming_priority(users):
    response = users["third"].upload(20, priority="high")
    assert response.status_code == 400, response.text
    body = response.json()
    assert "priority" in body["errors"], body
    assert "priority 'high' is above your highest allowed priority ('normal')" in body["detail"]
    unknown = users["third"].upload(20, priority="urgent")
    assert unknown.status_code == 400 and "priority" in unknown.json()["errors"], unknown.text


def test_a_high_priority_job_ends_before_a_running_normal_one_and_a_low_one_still_advances(users, shares):
    a, b, c = users["tester"], users["other"], users["third"]
    normal = a.start(BIG_ROWS)
    a.wait_for_rows(normal, 2 * CHUNK_ROWS)
    shares("other", max_priority="high")
    high_rows, low_rows = 1000, 1000
    high = b.start(high_rows, priority="high")
    low = c.start(low_rows, priority="low")
    wait_until(lambda: b.job(high)["status"] in ("queued", "running", *ENDED), 120, "the high job's file to be read")
    normal_at_high_queued = a.job(normal)

    high_end = b.wait_for_end(high)
    normal_at_high_end = a.job(normal)
    assert (high_end["status"], high_end["done_rows"]) == ("succeeded", high_rows), high_end
    assert high_end["priority"] == "high"
    assert normal_at_high_end["status"] == "running", "the high-priority job waited for the normal one"
    normal_meanwhile = normal_at_high_end["done_rows"] - normal_at_high_queued["done_rows"]
    # Bands share 400:20, so the normal job gets about 1 chunk in 21 while the high one has work.
    assert normal_meanwhile < high_rows / 2, f"the normal job ran {normal_meanwhile} rows beside {high_rows} high"

    # The low band keeps a share (20:1 against normal): its job advances, chunk after chunk, while the
    # normal job still runs, instead of waiting for it to end.
    def low_progress() -> dict | None:
        low_job, normal_job = c.job(low), a.job(normal)
        if normal_job["status"] in ENDED or low_job["done_rows"] >= 3 * CHUNK_ROWS:
            return {"low": low_job, "normal": normal_job}
        return None

    seen = wait_until(low_progress, 300, "the low job to advance or the normal one to end")
    assert seen["normal"]["status"] == "running", f"the low job had {seen['low']['done_rows']} rows done at the end"
    assert seen["low"]["done_rows"] >= 3 * CHUNK_ROWS
    assert seen["low"]["status"] == "running" and seen["low"]["priority"] == "low"
    print(
        f"\nhigh: {high_rows} rows while the normal job ran {normal_meanwhile}; low: {seen['low']['done_rows']} rows"
        f" done while the normal job had {remaining(seen['normal'])} left"
    )


# Quotas ---------------------------------------------------------------------------------------------


def running_job(user: User, rows: int) -> int:
    job_id = user.start(rows)
    wait_until(lambda: user.job(job_id)["status"] == "running", 120, f"job {job_id} to run")
    return job_id


def test_past_the_unfinished_jobs_quota_an_upload_is_a_429_naming_it(users, shares):
    a = users["tester"]
    first = running_job(a, 2000)
    shares("tester", max_unfinished_jobs=1)
    refused = a.upload(20)
    assert refused.status_code == 429, refused.text
    body = refused.json()
    assert body["code"] == "quota_unfinished_jobs", body
    detail = body["detail"]
    assert "quota of unfinished jobs reached" in detail and "you have 1 " in detail and "at most 1;" in detail, body
    assert "cancel one" in detail
    a.cancel(first)
    assert a.wait_for_end(first)["status"] == "cancelled"
    again = a.start(20)  # the quota counts live jobs: with the first one ended, the next is taken
    assert a.wait_for_end(again)["status"] == "succeeded"


def test_past_the_queued_rows_quota_an_upload_is_a_429_naming_it(users, shares):
    a = users["tester"]
    first = running_job(a, 2000)
    shares("tester", max_queued_rows=100)
    refused = a.upload(20)
    assert refused.status_code == 429, refused.text
    body = refused.json()
    assert body["code"] == "quota_queued_rows", body
    assert "quota of queued rows reached" in body["detail"] and "may have at most 100" in body["detail"], body
    other = users["other"].start(20)  # a quota is its user's own: others upload as before
    assert users["other"].wait_for_end(other)["status"] == "succeeded"
    a.cancel(first)


def test_a_file_with_more_rows_than_the_quota_leaves_fails_at_ingest_naming_the_quota(users, shares):
    a = users["tester"]
    shares("tester", max_queued_rows=100)
    over = a.start(200)  # its rows are counted once read: accepted, then failed
    failed = a.wait_for_end(over)
    assert failed["status"] == "failed" and failed["total_rows"] == 0, failed
    assert "quota of queued rows: this file has 200 rows" in failed["error"], failed
    assert "your quota of 100" in failed["error"] and "split the file" in failed["error"], failed
    within = a.start(100)
    assert a.wait_for_end(within)["status"] == "succeeded"


# Faults with three users' jobs running ----------------------------------------------------------------


def shared_offline_child(stack) -> int:
    """The pid of the stack's one offline child (waits out a heartbeat entry left by a worker just gone)."""
    (child,) = wait_until(
        lambda: (found := stack.children("offline")) and len(found) == 1 and found, 60, "one offline child"
    )
    return child["pid"]


def test_a_killed_offline_child_with_three_users_jobs_loses_nothing_and_keeps_the_fair_order(stack, users):
    sizes = {"tester": 2500, "other": 2000, "third": 1500}
    big = {name: users[name].start(rows) for name, rows in sizes.items()}
    for name, job_id in big.items():  # all three under way: the pool is shared
        users[name].wait_for_rows(job_id, CHUNK_ROWS, timeout_s=180)
    os.kill(shared_offline_child(stack), signal.SIGKILL)
    small_owner = users["other"]  # a user whose own big job is running too
    small = small_owner.start(20)
    ended = small_owner.wait_for_end(small)
    at_small_end = {name: users[name].job(job_id) for name, job_id in big.items()}
    assert (ended["status"], ended["done_rows"]) == ("succeeded", 20), ended
    for name, job in at_small_end.items():
        assert job["status"] == "running", f"{name}'s big job ended before the small one uploaded after the kill"
        assert remaining(job) >= 5 * CHUNK_ROWS, f"{name}'s big job was almost done: {job}"
    for name, job_id in big.items():
        users[name].wait_for_end(job_id, timeout_s=600)
        users[name].assert_every_row_done_once(job_id, sizes[name])
    small_owner.assert_every_row_done_once(small, 20)


def offline_messages(stack) -> list[int]:
    """The chunk ids of the run messages waiting in the broker's offline lists (kombu: one list per queue
    and priority, named after it)."""
    chunk_ids = []
    for key in stack.redis.scan_iter("offline*"):
        if stack.redis.type(key) != "list":
            continue
        for raw in stack.redis.lrange(key, 0, -1):
            message = json.loads(raw)
            if message["headers"].get("task") != "jobs.run_chunk":
                continue
            _args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
            chunk_ids.append(int(kwargs["chunk_id"]))
    return chunk_ids


def unacked_offline(stack) -> int:
    """Messages delivered to a consumer and not yet acknowledged, on the offline queue."""
    return sum(1 for raw in stack.redis.hvals("unacked") if json.loads(raw)[-1] == "offline")


def in_transaction(django_db_blocker) -> int:
    """Database sessions other than ours inside a transaction (holding whatever locks they took)."""
    from django.db import connection

    if connection.vendor != "postgresql":  # SQLite: a stopped writer's lock would show as a timeout instead
        return 0
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%%'"
        )
        return cursor.fetchone()[0]


def freeze(stack, django_db_blocker) -> None:
    """SIGSTOP the shared offline worker, at a moment it holds no transaction (else its row locks would
    stop the other worker too, which no real crash does: a dead process's locks are released)."""
    for _ in range(50):
        os.killpg(stack.offline.pid, signal.SIGSTOP)
        if in_transaction(django_db_blocker) == 0:
            break
        os.killpg(stack.offline.pid, signal.SIGCONT)
        time.sleep(0.1)
    else:
        raise AssertionError("the shared offline worker was always inside a transaction")
    # A BRPOP it had sent before it stopped still takes a message that arrives within kombu's BRPOP
    # timeout (1 s, server side): nothing observable says it has passed, so wait it out.
    time.sleep(1.5)


def start_offline_worker(stack, name: str) -> subprocess.Popen:
    """A second offline worker as the fixture starts the first (tests/conftest.py celery_worker)."""
    port = stack.url.rsplit(":", 1)[1]
    command = [str(Path(sys.executable).parent / "celery"), "-A", "platform_", "worker", "-Q", "offline"]
    command += ["-c", "1", "-P", "prefork", "--prefetch-multiplier", "4", "--without-gossip", "--without-mingle"]
    command += ["-n", f"test-{name}-{port}@%h", "--loglevel", "INFO"]
    env = {**stack.env, "WORKER_QUEUE": "offline", "WORKER_MODELS": "router"}
    log = (stack.log_dir / f"{name}.log").open("w")
    return subprocess.Popen(
        command, cwd=Path(__file__).resolve().parents[2], env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def chunk_states(django_db_blocker, job_ids: list[int]) -> dict:
    from django.db.models import Count, F, Sum

    from jobs.models import Chunk, ChunkStatus, JobRow, RowStatus

    with django_db_blocker.unblock():
        chunks = Chunk.objects.filter(job_id__in=job_ids)
        done_in_chunks = dict(
            chunks.filter(status=ChunkStatus.DONE)
            .values_list("job_id")
            .annotate(rows=Sum(F("end_index") - F("first_index")))
        )
        done_rows = dict(
            JobRow.objects.filter(job_id__in=job_ids, status=RowStatus.DONE)
            .values_list("job_id")
            .annotate(rows=Count("pk"))
        )
        return {
            "statuses": set(chunks.values_list("status", flat=True)),
            "running": Chunk.objects.filter(status=ChunkStatus.RUNNING).count(),
            "sent_unclaimed": sorted(
                Chunk.objects.filter(status=ChunkStatus.QUEUED, dispatched_at__isnull=False).values_list(
                    "pk", flat=True
                )
            ),
            "done_in_chunks": {job_id: done_in_chunks.get(job_id, 0) for job_id in job_ids},
            "done_rows": {job_id: done_rows.get(job_id, 0) for job_id in job_ids},
        }


def test_sigterm_of_an_offline_worker_with_three_users_jobs_hands_back_what_it_held(stack, users, django_db_blocker):
    """A second offline worker takes the work while the shared one is frozen; SIGTERM mid-way: it ends the
    batch in its child, exits 0, and gives back its prefetched messages. Then the broker holds one message
    per chunk sent and not claimed, nothing is half-done, and the shared worker, thawed, finishes every job."""
    second = start_offline_worker(stack, "offline-second")
    try:
        wait_until(lambda: len(stack.children("offline")) == 2, 180, "the second offline worker's child")
        freeze(stack, django_db_blocker)
        sizes = {"tester": 1500, "other": 1200, "third": 1000}
        big = {name: users[name].start(rows) for name, rows in sizes.items()}
        for name, job_id in big.items():
            users[name].wait_for_rows(job_id, CHUNK_ROWS, timeout_s=180)
        second.send_signal(signal.SIGTERM)  # to the main process, as an orchestrator stops a container
        assert second.wait(timeout=120) == 0, (stack.log_dir / "offline-second.log").read_text()[-4000:]

        state = chunk_states(django_db_blocker, list(big.values()))
        assert state["running"] == 0, "a chunk was left running"
        assert state["statuses"] <= {"done", "queued"}, state
        # Nothing half-done: the rows done are exactly those of the chunks done.
        assert state["done_rows"] == state["done_in_chunks"], state
        for name, job_id in big.items():
            assert 0 < state["done_rows"][job_id] < sizes[name], f"SIGTERM was not mid-way for {name}: {state}"
        messages = offline_messages(stack)
        assert sorted(messages) == state["sent_unclaimed"], (
            f"{len(messages)} run messages in the broker for {len(state['sent_unclaimed'])} chunks sent and not "
            f"claimed: {sorted(messages)} vs {state['sent_unclaimed']}"
        )
        assert unacked_offline(stack) == 0
        assert all(users[name].job(job_id)["status"] == "running" for name, job_id in big.items())
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait(timeout=30)
        os.killpg(stack.offline.pid, signal.SIGCONT)
    for name, job_id in big.items():
        users[name].wait_for_end(job_id, timeout_s=600)
        users[name].assert_every_row_done_once(job_id, sizes[name])
    shared_offline_child(stack)  # the second worker's heartbeat is gone: later tests see one child
    print(
        f"\nSIGTERM: {sum(state['done_rows'].values())} rows done, {len(messages)} messages handed back for "
        f"{len(state['sent_unclaimed'])} sent chunks; the shared worker finished the rest"
    )
