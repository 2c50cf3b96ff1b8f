"""CoalescedScript against a real Redis: the script calls one pass of the event loop makes share one
round trip, each gets its own answer in the order made, and errors reach the calls they belong to."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import redis
import redis.asyncio as aredis

from platform_.redis import CoalescedScript
from tests.conftest import free_port

# Appends its argument to a list and answers the list's length; fails on "boom".
APPEND = """
if ARGV[1] == 'boom' then return redis.error_reply('boom asked for') end
return redis.call('RPUSH', KEYS[1], ARGV[1])
"""


@pytest.fixture
def url(redis_url):
    return redis_url.rsplit("/", 1)[0] + "/14"


@contextlib.asynccontextmanager
async def appending(url: str, key: str):
    """A client of the test Redis with `key` emptied, and APPEND coalesced on it; the client closed after."""
    client = aredis.Redis.from_url(url, decode_responses=True)
    try:
        await client.delete(key)
        yield client, CoalescedScript(client, APPEND)
    finally:
        await client.aclose()


def test_calls_made_in_one_pass_share_one_round_trip_and_keep_their_order(url):
    async def main():
        async with appending(url, "coalesced:list") as (client, script):
            answers = await asyncio.gather(*(script(["coalesced:list"], [f"v{n}"]) for n in range(20)))
            stored = await client.lrange("coalesced:list", 0, -1)
        return script, answers, stored

    script, answers, stored = asyncio.run(main())
    assert answers == list(range(1, 21))  # each call its own answer, in the order made
    assert stored == [f"v{n}" for n in range(20)]
    assert (script.calls, script.round_trips) == (20, 1)


def test_a_pass_with_more_calls_than_one_round_trip_takes_is_split_in_order(url):
    async def main():
        async with appending(url, "coalesced:many") as (client, script):
            answers = await asyncio.gather(*(script(["coalesced:many"], [f"v{n}"]) for n in range(150)))
            stored = await client.lrange("coalesced:many", 0, -1)
        return script, answers, stored

    script, answers, stored = asyncio.run(main())
    assert answers == list(range(1, 151))
    assert stored == [f"v{n}" for n in range(150)]
    assert (script.calls, script.round_trips) == (150, 3)  # 64 + 64 + 22


def test_large_calls_are_not_packed_into_one_buffer(url):
    """Three 600 KB calls and two small ones in one pass: no round trip over 1 MiB but a lone call's, in order."""

    async def main():
        async with appending(url, "coalesced:large") as (client, script):
            values = ["s1", "L" * 600_000, "L" * 600_000, "s2", "L" * 600_000]
            answers = await asyncio.gather(*(script(["coalesced:large"], [v]) for v in values))
            stored = await client.lrange("coalesced:large", 0, -1)
        return script, values, answers, stored

    script, values, answers, stored = asyncio.run(main())
    assert answers == [1, 2, 3, 4, 5] and stored == values
    # [s1, L], [L, s2], [L]: a pipeline closes before the call that would take it past 1 MiB.
    assert script.round_trips == 3


def test_a_lone_call_and_calls_in_later_passes_are_answered(url):
    async def main():
        async with appending(url, "coalesced:lone") as (client, script):
            first = await script(["coalesced:lone"], ["a"])
            second = await script(["coalesced:lone"], ["b"])
        return script, first, second

    script, first, second = asyncio.run(main())
    assert (first, second) == (1, 2)
    assert (script.calls, script.round_trips) == (2, 2)


def test_one_calls_script_error_reaches_that_call_only(url):
    async def main():
        async with appending(url, "coalesced:err") as (client, script):
            answers = await asyncio.gather(
                script(["coalesced:err"], ["x"]),
                script(["coalesced:err"], ["boom"]),
                script(["coalesced:err"], ["y"]),
                return_exceptions=True,
            )
        return answers

    first, failed, third = asyncio.run(main())
    assert (first, third) == (1, 2)
    assert isinstance(failed, redis.ResponseError) and "boom asked for" in str(failed)


def test_a_server_that_lost_the_script_is_sent_it_again(url):
    """After SCRIPT FLUSH (a restart or a failover to a replica that never saw it) the pipeline gets
    NOSCRIPT: every call is still answered, once."""

    async def main():
        async with appending(url, "coalesced:flush") as (client, script):
            await script(["coalesced:flush"], ["warm"])
            await client.script_flush()
            answers = await asyncio.gather(*(script(["coalesced:flush"], [f"v{n}"]) for n in range(5)))
            stored = await client.lrange("coalesced:flush", 0, -1)
        return answers, stored

    answers, stored = asyncio.run(main())
    assert answers == [2, 3, 4, 5, 6]
    assert stored == ["warm", "v0", "v1", "v2", "v3", "v4"]


def test_a_script_error_on_the_resend_after_noscript_reaches_its_own_call_only(url):
    async def main():
        async with appending(url, "coalesced:flush-err") as (client, script):
            await client.script_flush()
            answers = await asyncio.gather(
                *(script(["coalesced:flush-err"], [value]) for value in ("a", "boom", "b")), return_exceptions=True
            )
        return answers

    first, failed, third = asyncio.run(main())
    assert (first, third) == (1, 2)
    assert isinstance(failed, redis.ResponseError) and "boom asked for" in str(failed)


def test_a_caller_that_hangs_up_before_its_pass_is_sent_is_not_sent(url):
    async def main():
        async with appending(url, "coalesced:cancel") as (client, script):
            calls = [asyncio.ensure_future(script(["coalesced:cancel"], [f"v{n}"])) for n in range(3)]
            await asyncio.sleep(0)  # the three are made and waiting for the next pass
            calls[1].cancel()
            answers = await asyncio.gather(*calls, return_exceptions=True)
            stored = await client.lrange("coalesced:cancel", 0, -1)
        return answers, stored

    (first, cancelled, third), stored = asyncio.run(main())
    assert isinstance(cancelled, asyncio.CancelledError)
    assert (first, third) == (1, 2) and stored == ["v0", "v2"]  # the others answered; it never ran


def test_an_unreachable_server_fails_every_call_of_the_round_trip_with_a_redis_error():
    async def main():
        client = aredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
        script = CoalescedScript(client, APPEND)
        answers = await asyncio.gather(*(script(["k"], ["v"]) for _ in range(3)), return_exceptions=True)
        await client.aclose()
        return answers

    answers = asyncio.run(main())
    assert len(answers) == 3 and all(isinstance(a, redis.ConnectionError) for a in answers), answers
    assert len({id(a) for a in answers}) == 3  # each caller raises its own copy, not one shared instance
