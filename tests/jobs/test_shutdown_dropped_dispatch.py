"""A warm shutdown that lands between a dispatch and its child's acceptance leaves no copy of the chunk behind.

Issue 23 item 7: the multihost SIGTERM test (tests/multihost/test_workers_on_other_hosts.py) once found one
offline message too many after the offline worker stopped, a copy of a chunk the stopping worker had
finished. The cause: as the worker stops, Celery's consumer flushes the pool (Consumer.on_close ->
AsynPool.flush), which drops every job whose acceptance by a child the main process has not read yet, with
its callbacks. A job already in the child's pipe is run by that child all the same; its chunk ends done, but
the dispatcher's `finished` never runs, the message is never acknowledged, and kombu restores it when the
consumer's channel closes ("Restoring 1 unacknowledged message").

Here the case is made on purpose, on a stack of its own (its own Redis): the offline child is frozen
(SIGSTOP) before a job is uploaded, so the chunk the worker is sent reaches the child's pipe and is not
accepted; SIGTERM; the child is thawed once the pool, joining, has written its stop sentinel behind the job
(the consumer has flushed the pool by then). The child runs the chunk, and what the broker holds afterwards
is one message per chunk sent and not claimed, and nothing else.
"""

from __future__ import annotations

import array
import base64
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import termios
from pathlib import Path

import psutil
import pytest
import requests

from tests.conftest import private_stack, wait_until
from tests.jobs.test_jobs_api import make_csv, upload

CHUNK_ROWS = 10
ROWS = 60  # read in the upload request (JOBS_INLINE_INGEST_BYTES): the frozen child has no ingest to run
EXTRA_ENV = {
    "JOBS_CHUNK_ROWS": str(CHUNK_ROWS),
    "JOBS_DISPATCH_ROWS": str(CHUNK_ROWS),  # one chunk a dispatch
    # The reconciler must not take back the chunk the frozen child holds: what the worker gives back at
    # shutdown, it gives back itself.
    "JOBS_STALL_S": "600",
}


@pytest.fixture(scope="module")
def own_stack(django_db_setup, django_db_blocker, models_file, tmp_path_factory):
    with private_stack("dropped", django_db_blocker, models_file, tmp_path_factory, extra_env=EXTRA_ENV) as stack:
        yield stack


def pipe_bytes(pid: int) -> dict[str, int]:
    """Bytes waiting in each pipe the process `pid` reads from, by pipe (`pipe:[inode]`): FIONREAD on the
    pipe, opened anew through /proc (nothing is read from it)."""
    waiting = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            target = os.readlink(path)
            flags = re.search(r"flags:\s*(\d+)", Path(f"/proc/{pid}/fdinfo/{fd}").read_text())
            if not target.startswith("pipe:") or not flags or int(flags.group(1), 8) & os.O_ACCMODE != os.O_RDONLY:
                continue
            handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:  # closed meanwhile
            continue
        try:
            count = array.array("i", [0])
            fcntl.ioctl(handle, termios.FIONREAD, count)
            waiting[target] = count[0]
        finally:
            os.close(handle)
    return waiting


def offline_messages(stack) -> list[int]:
    """The chunk ids of the run messages waiting in the broker's offline lists (kombu: one list per queue and
    priority, named after it)."""
    chunk_ids = []
    for key in stack.redis.scan_iter("offline*"):
        if stack.redis.type(key) != "list":
            continue
        for raw in stack.redis.lrange(key, 0, -1):
            message = json.loads(raw)
            if message["headers"].get("task") == "jobs.run_chunk":
                _args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
                chunk_ids.append(int(kwargs["chunk_id"]))
    return chunk_ids


def unacked_offline(stack) -> list[int]:
    """The chunk ids of offline messages delivered to a consumer and not acknowledged."""
    chunk_ids = []
    for raw in stack.redis.hvals("unacked"):
        message, _exchange, routing_key = json.loads(raw)
        if routing_key == "offline":
            _args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
            chunk_ids.append(int(kwargs["chunk_id"]))
    return chunk_ids


def chunks_of(django_db_blocker, job_id: int) -> dict[int, tuple[str, bool]]:
    """Each chunk of the job: (status, sent)."""
    from jobs.models import Chunk

    with django_db_blocker.unblock():
        rows = Chunk.objects.filter(job_id=job_id).values_list("pk", "status", "dispatched_at")
        return {pk: (status, sent is not None) for pk, status, sent in rows}


def start_offline_worker(stack, name: str) -> subprocess.Popen:
    """Another offline worker on the stack, as running_stack starts its own."""
    port = stack.url.rsplit(":", 1)[1]
    command = [str(Path(sys.executable).parent / "celery"), "-A", "platform_", "worker", "-Q", "offline"]
    command += ["-c", "1", "-P", "prefork", "--prefetch-multiplier", "4", "--without-gossip", "--without-mingle"]
    command += ["-n", f"test-{name}-{port}@%h", "--loglevel", "INFO"]
    env = {**stack.env, "WORKER_QUEUE": "offline", "WORKER_MODELS": "router"}
    log = (stack.log_dir / f"{name}.log").open("w")
    return subprocess.Popen(
        command,
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.mark.integration
def test_sigterm_before_the_child_accepts_a_chunk_leaves_no_copy_of_it(own_stack, django_db_blocker):
    stack = own_stack
    log = stack.log_dir / "offline.log"
    (entry,) = stack.children("offline")
    child = psutil.Process(entry["pid"])
    child.suspend()
    try:
        response = upload(stack, make_csv(ROWS))
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]

        def sent_to_the_child() -> tuple[str, int] | None:
            # The worker took the chunk the scheduler sent (kombu's unacked hash has it, the list is empty)
            # and wrote the dispatch to its one child's pipe, where it waits: the child is frozen.
            if len(unacked_offline(stack)) != 1 or offline_messages(stack):
                return None
            waiting = [(pipe, count) for pipe, count in pipe_bytes(child.pid).items() if count > 0]
            return waiting[0] if len(waiting) == 1 else None

        job_pipe, job_bytes = wait_until(sent_to_the_child, 60, "the chunk dispatched to the frozen child")
        (held,) = unacked_offline(stack)
        assert chunks_of(django_db_blocker, job_id)[held] == ("queued", True)

        stack.offline.send_signal(signal.SIGTERM)  # warm shutdown, to the main process
        # The pool is joined once the consumer has stopped (and flushed the pool): its stop sentinel follows
        # the job in the child's pipe.
        wait_until(
            lambda: pipe_bytes(child.pid).get(job_pipe, 0) > job_bytes,
            30,
            "the pool's stop sentinel behind the job",
            interval_s=0.05,
        )
    finally:
        child.resume()
    assert stack.offline.wait(timeout=120) == 0, log.read_text()[-4000:]

    chunks = chunks_of(django_db_blocker, job_id)
    assert chunks[held][0] == "done", f"the child did not run the chunk it was sent: {chunks}"
    sent_unclaimed = sorted(pk for pk, (status, sent) in chunks.items() if status == "queued" and sent)
    messages = offline_messages(stack)
    # No copy of the chunk the child ran (before the fix kombu restored its message at shutdown), one message
    # per chunk sent and not claimed (the next one, sent when the child claimed the held chunk), each once.
    # (Not `messages == sent_unclaimed`: jobs live in the database every stack of the test session shares, so
    # the session's own stack may run this job's other chunks meanwhile, the one whose message is here too.)
    assert held not in messages, f"messages for chunks {sorted(messages)}; {chunks}"
    assert set(sent_unclaimed) <= set(messages) and len(messages) == len(set(messages)), (messages, chunks)
    assert all(chunks[pk][1] for pk in messages), f"a message for a chunk never sent: {messages}; {chunks}"
    assert unacked_offline(stack) == []
    logged = log.read_text()
    assert "the pool dropped dispatches of 1 acks_late requests at shutdown: 1 taken by a child anyway" in logged
    assert "Restoring" not in logged, logged[-4000:]

    # Nothing was lost: another offline worker finishes the job, every row done once.
    other = start_offline_worker(stack, "offline-after")
    try:

        def ended() -> dict | None:
            job = requests.get(
                f"{stack.url}/api/v1/jobs/{job_id}", headers={"Authorization": f"Token {stack.token}"}, timeout=10
            ).json()
            return job if job["status"] in {"succeeded", "partial", "failed", "cancelled"} else None

        job = wait_until(ended, 180, "the job to end on the other worker", interval_s=0.5)
    finally:
        os.killpg(other.pid, signal.SIGTERM)
        other.wait(timeout=60)
    assert (job["status"], job["done_rows"], job["failed_rows"]) == ("succeeded", ROWS, 0), job
    from jobs.models import JobRow

    with django_db_blocker.unblock():
        attempts = set(JobRow.objects.filter(job_id=job_id).values_list("attempts", flat=True))
    assert attempts == {1}, "a row was run more than once"
    print(f"\nshutdown before acceptance: chunk {held} run by the stopping worker's child, acknowledged; {chunks}")


def test_the_event_loop_runs_what_a_close_callback_queues_before_it_is_closed():
    """What the fix relies on in kombu's Hub: AdaptiveBatches._settle_dropped runs as a close callback, and
    the acknowledgements it queues (Celery sends them through hub.call_soon) run before close returns."""
    from kombu.asynchronous import Hub

    hub = Hub()
    ran = []
    hub.on_close.add(lambda loop: loop.call_soon(ran.append, "ack"))
    hub.close()
    assert ran == ["ack"]
