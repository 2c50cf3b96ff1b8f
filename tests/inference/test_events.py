"""Task events for batches (inference/dispatch/events.py) and Flower's Broker tab (flowerconfig.py).

Flower builds its task list and counters with `celery.events.state.State` (its EventsState extends it),
so the tests feed the events to one and check what Flower would show: one task per dispatched batch,
its name, state, runtime and what it carried.
"""

from __future__ import annotations

import ast
import runpy
import threading
import time
import types
from pathlib import Path

import pytest
from celery import Celery
from celery.events.state import State
from celery_batches import Batches
from kombu import Connection
from kombu.clocks import LamportClock

from inference.dispatch.events import BatchEvents, BatchFailed, apply_batch

ROOT = Path(__file__).resolve().parents[2]


class FakeEventer:
    """The parts of Celery's EventDispatcher that BatchEvents uses; records each published message."""

    def __init__(self, enabled: bool = True, groups: set[str] | None = None) -> None:
        self.hostname, self.pid, self.clock = "online@test", 4242, LamportClock()
        self.enabled, self.groups = enabled, groups or set()
        self.mutex, self.producer = threading.Lock(), object()
        self.published: list[tuple[list[dict], str]] = []

    def _publish(self, events: list[dict], producer: object, routing_key: str) -> None:
        self.published.append((events, routing_key))


class FakeTimer:
    def __init__(self) -> None:
        self.armed: list[float] = []

    def call_after(self, seconds: float, fun) -> None:
        self.armed.append(seconds)


def make(eventer: FakeEventer | None = None, send_events: bool = True):
    eventer = eventer or FakeEventer()
    task = types.SimpleNamespace(
        name="inference.predict_online", send_events=send_events, request_texts=lambda r: len(r.kwargs["inputs"])
    )
    consumer = types.SimpleNamespace(event_dispatcher=eventer, timer=FakeTimer())
    return BatchEvents(consumer, task), eventer, consumer


def request(model: str = "router", texts: int = 1):
    return types.SimpleNamespace(kwargs={"model": model, "inputs": ["a text"] * texts})


def flower_state(eventer: FakeEventer) -> State:
    state = State()
    for events, _ in eventer.published:
        for event in events:
            state.event({**event, "local_received": time.time()})  # as Celery's EventReceiver adds on receipt
    return state


def test_a_batch_is_one_task_with_its_requests_and_runtime():
    events, eventer, consumer = make()
    batch = events.dispatched([request(texts=2), request(), request("embedding")])
    events.started(batch, pid=99)
    time.sleep(0.01)
    events.finished(batch, None)
    assert eventer.published == [], "events wait for the flush"
    assert consumer.timer.armed == [events.flush_interval_s], "one flush armed, not one per event"
    events.flush()

    assert len(eventer.published) == 1 and eventer.published[0][1] == "task.multi"
    state = flower_state(eventer)
    (task,) = state.tasks.values()
    assert task.name == "inference.predict_online" and task.state == "SUCCESS"
    assert task.worker.hostname == "online@test"
    assert task.kwargs == repr({"models": ["embedding", "router"], "requests": 3, "texts": 4})
    assert task.runtime >= 0.01 and task.received <= task.started <= task.succeeded


def test_many_batches_share_one_publish():
    events, eventer, _ = make()
    for _ in range(50):
        batch = events.dispatched([request()])
        events.started(batch, pid=1)
        events.finished(batch, None)
    events.flush()
    assert len(eventer.published) == 1
    state = flower_state(eventer)
    assert len(state.tasks) == 50 and {t.state for t in state.tasks.values()} == {"SUCCESS"}


def test_a_full_buffer_is_published_at_once():
    events, eventer, _ = make()
    events.max_buffered = 6
    for _ in range(2):
        batch = events.dispatched([request()])
        events.started(batch, pid=1)
        events.finished(batch, None)
    assert len(eventer.published) == 1 and len(eventer.published[0][0]) == 6


def test_a_lost_batch_and_a_raising_batch_fail():
    events, eventer, _ = make()
    lost = events.dispatched([request()])
    events.started(lost, pid=1)
    events.lost(lost, RuntimeError("worker exited prematurely: signal 9"))
    raised = events.dispatched([request()])
    events.started(raised, pid=1)
    events.finished(raised, BatchFailed(("ValueError('bad input')",)))
    events.flush()
    state = flower_state(eventer)
    assert state.tasks[lost.id].state == "FAILURE" and "signal 9" in state.tasks[lost.id].exception
    assert state.tasks[raised.id].state == "FAILURE" and state.tasks[raised.id].exception == "ValueError('bad input')"


@pytest.mark.parametrize(
    "eventer, send_events",
    [(FakeEventer(enabled=False), True), (FakeEventer(groups={"worker"}), True), (FakeEventer(), False)],
    ids=["events off", "task events off", "task without send_events"],
)
def test_no_events_when_switched_off(eventer, send_events):
    events, eventer, _ = make(eventer, send_events)
    batch = events.dispatched([request()])
    events.started(batch, pid=1)
    events.finished(batch, None)
    events.flush()
    assert batch is None and eventer.published == []


def test_a_broken_eventer_never_stops_a_dispatch():
    events, eventer, _ = make()
    eventer.clock = None  # every event fails to build
    batch = events.dispatched([request()])
    events.started(batch, pid=1)
    events.finished(batch, None)
    events.flush()
    assert eventer.published == []


def test_apply_batch_tells_a_raising_batch_from_a_good_one():
    app = Celery("events-test", set_as_current=False)

    @app.task(base=Batches, name="test.good")
    def good(requests):
        return len(requests)

    @app.task(base=Batches, name="test.bad")
    def bad(requests):
        raise ValueError("bad input")

    assert apply_batch(good, ([1, 2],), 0, None) == 2
    failed = apply_batch(bad, ([1],), 0, None)
    assert isinstance(failed, BatchFailed) and failed.exception == "ValueError('bad input')"
    assert apply_batch(good, ([1],), 0, None) == 1, "an earlier failure is not carried over"


# Flower's Broker tab ----------------------------------------------------------------------------


def test_broker_tab_lists_every_platform_queue_whichever_workers_answered(settings, tmp_path, request):
    """The offline worker answered no inspect (busy at low priority): its queue is listed all the same."""
    models = tmp_path / "models.yaml"
    models.write_text(
        "default: router\nmodels:\n"
        "  router: {task: identity, path: x}\n"
        "  embedding: {task: identity, path: x, queue: online.shared}\n"
        "  identity: {task: identity, path: x, queue: online.shared}\n"
    )
    from inference.core.registry import get_registry

    settings.INFERENCE_MODELS_FILE = str(models)
    get_registry.cache_clear()  # the registry is read once per process: read this file, then forget it
    request.addfinalizer(get_registry.cache_clear)
    config = runpy.run_path(str(ROOT / "flowerconfig.py"))
    assert config["inspect_timeout"] == 3000.0

    def only_the_online_worker_answered(handler):
        return ["online.router", "online.shared"]

    def nobody_answered(handler):  # Flower's fallback: the app's declared queues
        return ["offline", "online"]

    listed = config["_with_platform_queues"](only_the_online_worker_answered)
    assert listed(None) == ["offline", "online.router", "online.shared"]
    assert config["_with_platform_queues"](nobody_answered)(None) == ["offline", "online.router", "online.shared"]

    from flower.views import BaseHandler

    assert getattr(BaseHandler.get_active_queue_names, "platform_queues", False), "installed in Flower"


# On real worker processes -----------------------------------------------------------------------


def capture_events(redis_url: str, state: State, stop: threading.Event) -> threading.Thread:
    """Receive the stack's events into `state` in a thread, as Flower does (returns once subscribed)."""
    app = Celery("events-capture", broker=redis_url, set_as_current=False)
    ready = threading.Event()

    def run() -> None:
        with Connection(redis_url) as connection:
            receiver = app.events.Receiver(connection, handlers={"*": state.event})
            subscribed = receiver.on_consume_ready

            def on_consume_ready(*args, **kwargs) -> None:
                subscribed(*args, **kwargs)
                ready.set()

            receiver.on_consume_ready = on_consume_ready
            watcher = threading.Thread(target=lambda: (stop.wait(), setattr(receiver, "should_stop", True)))
            watcher.start()
            receiver.capture(limit=None, timeout=None, wakeup=False)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10), "event receiver did not start"
    return thread


def test_offline_batches_reach_flower_and_online_batches_only_when_asked(stack):
    """By default (ONLINE_TASK_EVENTS off) Flower sees offline dispatches and no online batch: at hundreds
    of batches a second their events cost Flower a tenth of a core (docs/benchmarks.md, issue 23)."""
    from tests.conftest import wait_until

    state, stop = State(), threading.Event()
    thread = capture_events(stack.env["REDIS_URL"], state, stop)
    try:
        for i in range(3):
            assert stack.predict("router", [f"my parcel {i} is late", "refund please"]).status_code == 200
        csv = "text\n" + "".join(f"row {i} about a refund\n" for i in range(120))
        response = __import__("requests").post(
            f"{stack.url}/api/v1/jobs",
            files={"file": ("e.csv", csv.encode())},
            data={"model": "router"},
            headers={"Authorization": f"Token {stack.token}"},
            timeout=30,
        )
        assert response.status_code in (201, 202), response.text

        def done(name: str) -> list:
            return [t for t in list(state.tasks.values()) if t.name == name and t.state == "SUCCESS"]

        offline = wait_until(lambda: done("jobs.run_chunk"), 120, "offline batches in the events")
        # The online batches ran before the job was even created; their events, had any been sent, were
        # published within 0.5 s, long before the offline ones arrived.
        online = done("inference.predict_online")
    finally:
        stop.set()
        thread.join(5)
    assert online == []
    assert offline[0].worker.hostname.startswith("test-offline-") and offline[0].runtime > 0
    rows = sum(ast.literal_eval(t.kwargs)["texts"] for t in offline)
    assert rows <= 120


@pytest.mark.parametrize("value, expected", [(None, False), ("1", True), ("0", False)])
def test_online_task_events_setting_decides_whether_online_batches_are_reported(value, expected):
    """The switch reaches the task Celery runs (BatchEvents above honours the task's `send_events`)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ONLINE_TASK_EVENTS"}
    if value is not None:
        env["ONLINE_TASK_EVENTS"] = value
    code = (
        "import django; django.setup(); from inference.tasks import predict_online; print(predict_online.send_events)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(expected)
