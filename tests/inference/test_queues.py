"""Per-model online queues (issue 11): a worker consumes only the queues of the models it loads."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import redis

from inference.core.keys import WORKERS_KEY, reply_key
from inference.core.queues import expand, online_queues, predicted_wait_s, served_models
from inference.core.registry import RegistryError, parse_registry
from inference.web.publish import task_message
from tests.conftest import _start, _stop

DEFAULTS = {"device": "cpu", "torch_threads": 1, "max_backlog": 8}


def registry(**extra):
    models = {
        "router": {"task": "router", "path": "x", "routes": "r.yaml"},
        "embedding": {"task": "embedding", "path": "x", "queue": "online.minilm"},
        "similar": {"task": "embedding", "path": "x", "queue": "online.minilm"},
        "identity": {"task": "identity", "path": "x"},
        **extra,
    }
    return parse_registry({"models": models}, **DEFAULTS)


def test_each_model_has_its_own_queue_unless_the_models_file_groups_them():
    assert online_queues(registry()) == {
        "online.router": ["router"],
        "online.minilm": ["embedding", "similar"],
        "online.identity": ["identity"],
    }


def test_a_queue_name_outside_the_online_namespace_is_refused():
    with pytest.raises(RegistryError, match="queue must be a name starting with 'online.'"):
        registry(bad={"task": "identity", "path": "x", "queue": "offline"})


def test_online_on_a_worker_means_the_queues_of_its_models():
    reg = registry()
    assert expand(["online"], reg) == ["online.router", "online.minilm", "online.identity"]
    assert expand(["online"], reg, ["similar"]) == ["online.minilm"]
    assert expand(["online.router", "offline"], reg, ["identity"]) == ["online.router", "offline"]


def test_a_worker_loads_every_model_of_the_queues_it_consumes_and_nothing_else():
    reg = registry()
    # WORKER_MODELS cannot split a group: a request taken from online.minilm must find its model loaded.
    assert served_models(["online.minilm"], reg, ["similar"]) == ["embedding", "similar"]
    assert served_models(["online.router"], reg) == ["router"]
    assert served_models(["offline"], reg, ["identity"]) == ["identity"]
    assert served_models(["online.nothing-here"], reg) == []


def test_predicted_wait_is_the_backlog_over_the_rate_shared_by_the_children():
    rates = {"a": 1000.0, "b": 250.0}
    assert predicted_wait_s({"a": 2000, "b": 500}, rates, children=2) == pytest.approx((2 + 2) / 2)
    assert predicted_wait_s({"a": 0, "b": 0}, rates, children=0) == 0.0
    assert predicted_wait_s({"a": 10}, rates, children=0) == float("inf")
    assert predicted_wait_s({"c": 10}, rates, children=1) is None  # work at a rate never measured


def test_a_worker_given_one_queue_takes_only_that_models_requests(stack, redis_url, tmp_path):
    """Before per-model queues, a worker given a subset of models still took every model's requests
    and answered 502 for the ones it lacked: a GPU host could not be dedicated to one model."""
    own_db = redis_url.rsplit("/", 1)[0] + "/11"  # its own queues: the stack's worker must not take these
    client = redis.Redis.from_url(own_db, decode_responses=True)
    client.flushdb()
    # What a worker of an earlier release left in Redis: its online queue bound to the offline exchange,
    # so kombu copied every offline message (job uploads and chunks) into the online list.
    stale = "\x06\x16".join(["offline", "", "online.identity"])
    client.sadd("_kombu.binding.offline", stale, "\x06\x16".join(["offline", "", "offline"]))
    command = [str(Path(sys.executable).parent / "celery"), "-A", "platform_", "worker", "-Q", "online.identity"]
    command += ["-c", "1", "--without-gossip", "--without-mingle", "-n", f"queues-{os.getpid()}@%h"]
    env = {k: v for k, v in stack.env.items() if k not in ("WORKER_QUEUE", "WORKER_MODELS")}
    worker = _start(command, {**env, "REDIS_URL": own_db}, tmp_path / "worker.log")
    log = tmp_path / "worker.log"

    def message(task_id: str, model: str) -> str:
        kwargs = {"model": model, "inputs": ["hello"], "tokens": [3], "client": "c", "deadline": time.time() + 60}
        return task_message(task_id, f"online.{model}", {**kwargs, "enqueued_at": time.time()})

    try:
        deadline = time.monotonic() + 60
        while client.hlen(WORKERS_KEY) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        children = [json.loads(v) for v in client.hvals(WORKERS_KEY)]
        assert children, log.read_text()[-3000:]
        client.lpush("online.router", message("for-router", "router"))
        client.lpush("online.identity", message("for-identity", "identity"))
        answer = client.blpop([reply_key("for-identity")], timeout=30)
        router_waiting = client.llen("online.router")
        router_answered = client.exists(reply_key("for-router"))
        offline_routes_to = {member.rsplit("\x06\x16", 1)[-1] for member in client.smembers("_kombu.binding.offline")}
        identity_routes_to = {
            member.rsplit("\x06\x16", 1)[-1] for member in client.smembers("_kombu.binding.online.identity")
        }
    finally:
        _stop(worker)
        client.flushdb()
    assert [child["models"] for child in children] == [["identity"]]  # only the queue's model was loaded
    assert {child["queue"] for child in children} == {"online"}
    assert answer is not None, log.read_text()[-3000:]
    assert json.loads(answer[1])["ok"]
    assert (router_waiting, router_answered) == (1, 0)  # left for a worker that serves router
    # Offline messages go to the offline list only; the online queue has an exchange of its own.
    assert offline_routes_to == {"offline"} and identity_routes_to == {"online.identity"}
