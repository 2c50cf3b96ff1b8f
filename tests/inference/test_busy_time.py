"""A child's busy time, which admission's drain rate divides tokens by, is time computing, not time writing.

CI's Sentinel failover test: a reply write that waited out a frozen primary (5 s) made a 55-token batch
count as 5 busy seconds, the model's drain rate read 11 tokens/s, and admission refused the model's
requests ("deadline") long after the failover. Real Redis; the forward pass is a stand-in (no torch here).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from inference.child import runtime, serving

PASS_S = 0.05
STALL_S = 0.6


class StallingClient:
    """A real Redis client whose pipelines take STALL_S longer to execute, as on a primary that froze."""

    def __init__(self, client) -> None:
        self._client = client

    def pipeline(self, *args, **kwargs):
        pipe = self._client.pipeline(*args, **kwargs)
        execute = pipe.execute

        def slow_execute(*a, **k):
            time.sleep(STALL_S)
            return execute(*a, **k)

        pipe.execute = slow_execute
        return pipe

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_a_stalled_reply_write_is_not_counted_as_busy_time(redis_client, monkeypatch):
    def fake_run(model, texts, on_pass=None, version=None, **_):
        passes = []
        for i in range(2):  # two passes of PASS_S; the first one's answers are written at once (> 1 ms)
            start = time.time()
            time.sleep(PASS_S)
            passes.append(runtime.Pass(start, time.time(), 1))
            if on_pass:
                on_pass([i], [{"label": "x"}] * len(texts), [passes[-1]] * len(texts))
        return [{"label": "x"}] * len(texts), [passes[0], passes[1]]

    monkeypatch.setattr(runtime, "run", fake_run)
    monkeypatch.setattr(runtime, "spec", lambda model, version=None: SimpleNamespace(version="1", max_batch_size=8))
    recorded = {}
    monkeypatch.setattr(serving, "record_batch", lambda client, model, **stats: recorded.update(stats))
    now = time.time()
    requests = [
        SimpleNamespace(
            id=f"busy-{i}-{now}",
            kwargs={"inputs": ["a text"], "deadline": now + 30, "enqueued_at": now, "tokens": [10]},
            received_at=now,
        )
        for i in range(2)
    ]
    serving._serve_model("router", requests, StallingClient(redis_client), None)
    assert recorded["busy_s"] < 2 * PASS_S + STALL_S / 2, recorded  # the passes, not the stalled writes
    assert recorded["busy_s"] >= 2 * PASS_S * 0.9
