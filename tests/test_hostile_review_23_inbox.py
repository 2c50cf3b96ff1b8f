"""Hostile review of the reply inbox (inference/web/inbox.py), the ASCII token counter
(inference/core/tokens.py `ascii_counter`) and ONLINE_TASK_EVENTS.

Each test here showed a defect (a strict xfail until it was fixed).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import string
import sys
import time
from pathlib import Path

from inference.core import tokens
from inference.core.registry import get_registry

# ---------------------------------------------------------------------------------------------------------
# 1. The inbox listener keeps the long read timeout of the old per-request BLPOPs
# ---------------------------------------------------------------------------------------------------------


def test_the_listener_gives_up_a_frozen_redis_within_a_few_listen_periods(tmp_path, settings, monkeypatch):
    from inference.web import inbox as inbox_module
    from platform_ import redis as platform_redis
    from tests.conftest import start_redis

    proc, url = start_redis(tmp_path)
    settings.REDIS_URL = url
    settings.REDIS_SENTINELS = []
    monkeypatch.setattr(platform_redis, "_async", {})
    frozen = False

    async def main() -> bool:
        nonlocal frozen
        client = platform_redis.get_async_redis(waits=True)  # what online.predict hands the inbox
        calls = {"started": 0, "raised_after_freeze": 0}
        blpop = client.blpop

        async def counted_blpop(*args, **kwargs):
            calls["started"] += 1
            try:
                return await blpop(*args, **kwargs)
            except BaseException:  # the listener's own stall timeout cancels it: given up as well
                if frozen:
                    calls["raised_after_freeze"] += 1
                raise

        client.blpop = counted_blpop
        inbox = inbox_module.Inbox("inference:inbox:hostile-frozen")
        inbox.expect("someone", client)
        try:
            async with asyncio.timeout(10):
                while calls["started"] < 2:  # one BLPOP done: connected, the next one is in flight
                    await asyncio.sleep(0.01)
            os.kill(proc.pid, signal.SIGSTOP)
            frozen = True
            # a listener whose reads give up like the sentinel clients' other commands (REDIS_SOCKET_TIMEOUT_S)
            limit = time.monotonic() + inbox_module.LISTEN_S + settings.REDIS_SOCKET_TIMEOUT_S + 1.0
            while time.monotonic() < limit and not calls["raised_after_freeze"]:
                await asyncio.sleep(0.02)
            return bool(calls["raised_after_freeze"])
        finally:
            inbox._listener.cancel()
            os.kill(proc.pid, signal.SIGCONT)
            await client.aclose()

    try:
        gave_up = asyncio.run(main())
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)
    assert gave_up, (
        "the listener still waited on the frozen Redis LISTEN_S + REDIS_SOCKET_TIMEOUT_S + 1 s after it froze"
    )


# ---------------------------------------------------------------------------------------------------------
# 2. The word memo holds up to 50,000 words of any length: ~100 MB per tokenizer per web process
# ---------------------------------------------------------------------------------------------------------


def _memo_of(counter) -> dict:
    for cell in counter.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, dict):
            return value
        if callable(value) and getattr(value, "__closure__", None):
            for inner in value.__closure__:
                if isinstance(inner.cell_contents, dict):
                    return inner.cell_contents
    raise AssertionError("no memo found")


def test_hostile_long_words_do_not_make_the_word_memo_hold_megabytes():
    tokenizer = tokens.tokenizer_for(get_registry().get("router"))
    counter = tokens.ascii_counter.__wrapped__(tokenizer)  # a fresh memo, not the process's
    prefix = tokens.CHARS_PER_TOKEN_BOUND * get_registry().get("router").max_seq_length  # what a request reaches
    for _ in range(tokens._WORD_MEMO_MAX // 50):
        # 50 requests' worth at a time: each text is one unique word as long as the counted prefix
        counter(" ".join(os.urandom(prefix // 2).hex() for _ in range(50)))
    held = sum(sys.getsizeof(word) for word in _memo_of(counter))
    assert held < 16 * 2**20, f"the memo holds {held / 2**20:.0f} MB of words"


# ---------------------------------------------------------------------------------------------------------
# 3. The counter is pure Python: a large request counted "off the event loop" now holds the GIL
# ---------------------------------------------------------------------------------------------------------


def _loop_ticks_while_counting(texts: list[str]) -> float:
    """Event-loop wake-ups per second while token_counts runs in a thread, as online._count_tokens runs a
    request of more than _INLINE_TOKENIZE_CHARS."""
    spec = get_registry().get("router")

    async def main() -> float:
        stop = False
        ticks = 0

        async def ticker():
            nonlocal ticks
            while not stop:
                await asyncio.sleep(0.001)
                ticks += 1

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        ticks = 0
        started = time.perf_counter()
        await asyncio.to_thread(tokens.token_counts_off_loop, spec, texts)  # as online._count_tokens does
        elapsed = time.perf_counter() - started
        stop = True
        await task
        return ticks / elapsed

    return asyncio.run(main())


def test_a_large_hostile_request_counted_in_a_thread_leaves_the_event_loop_its_turns(monkeypatch):
    rng = random.Random(23)

    def hostile() -> list[str]:  # fresh words each time: memo misses, as a hostile client makes them
        return [" ".join("".join(rng.choices(string.ascii_lowercase, k=100)) for _ in range(20)) for _ in range(64)]

    fast = _loop_ticks_while_counting(hostile())
    original = tokens.ascii_counter
    monkeypatch.setattr(tokens, "ascii_counter", lambda tokenizer: None)  # the library, as before the change
    library = _loop_ticks_while_counting(hostile())
    monkeypatch.setattr(tokens, "ascii_counter", original)
    assert fast >= 0.6 * library, f"event loop turns/s while counting: fast path {fast:.0f}, library {library:.0f}"


# ---------------------------------------------------------------------------------------------------------
# 4. The dashboard still tells operators that online batches are Flower tasks
# ---------------------------------------------------------------------------------------------------------


def test_the_dashboards_flower_explanation_says_online_batches_need_online_task_events(settings):
    assert settings.ONLINE_TASK_EVENTS is False
    page = (Path(__file__).resolve().parent.parent / "templates" / "dashboard.html").read_text()
    why = page[page.index('id="flower-why"') : page.index("</details>", page.index('id="flower-why"'))]
    assert "ONLINE_TASK_EVENTS" in why or "predict_online</code> is the requests" not in why
