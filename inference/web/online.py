"""An online prediction from the web tier's side: admit, enqueue, wait for the reply, account the time.

Everything here is async: a waiting request is a coroutine blocked on Redis, not a thread.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings

from inference.core.registry import ModelSpec, get_registry
from inference.core.replies import gather_reply
from inference.core.task_io import input_chars
from inference.core.tokens import token_counts, token_counts_off_loop
from inference.web import observe, versions
from inference.web.admission import Admission, Decision
from inference.web.inbox import get_inbox
from inference.web.publish import task_message
from platform_.redis import get_async_redis

_admissions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one per event loop


class Refused(Exception):
    """Admission said no; nothing was queued."""

    def __init__(self, decision: Decision, admission_ms: float) -> None:
        super().__init__(decision.reason)
        self.decision, self.admission_ms = decision, admission_ms


class DeadlineExceeded(Exception):
    """No answer came before the request's deadline; the worker will skip it if it has not started it."""

    def __init__(self, deadline_ms: int, admission_ms: float) -> None:
        super().__init__(f"no answer within {deadline_ms} ms")
        self.deadline_ms, self.admission_ms = deadline_ms, admission_ms


class WorkerFailed(Exception):
    """The worker answered with an error (the model raised, or its process died)."""

    def __init__(self, message: str, code: str = "worker_failed") -> None:
        super().__init__(message)
        # input_rejected: the model failed on this request's own input, run alone (see serving.py).
        self.code = code


@dataclass
class Prediction:
    outputs: list[dict[str, Any]]
    timing: dict[str, Any]
    worker: str
    # Each text's tokens as the model saw them (after truncation): what admission priced the request
    # by, and what the OpenAI-compatible API reports as its usage.
    tokens: list[int]
    # The model version that answered (the one this request was stamped with: inference/web/versions.py).
    model_version: str = ""


# Requests with more characters than this are tokenized in a thread (a short text takes ~0.2 ms inline).
_INLINE_TOKENIZE_CHARS = 8_000


def price(tokens: list[int]) -> int:
    """What a request costs the model, in tokens: its texts' tokens plus the fixed cost of a request."""
    return sum(tokens) + settings.ONLINE_REQUEST_OVERHEAD_TOKENS


async def _count_tokens(spec: ModelSpec, texts: list[str], admission: Admission, deadline: float) -> list[int]:
    """Each text's tokens; refused as too large (413) as soon as the count passes what could fit."""
    _, rate = await admission.capacity(spec.name)
    fits = admission.alone_fits(rate, deadline - time.time())
    overhead = settings.ONLINE_REQUEST_OVERHEAD_TOKENS
    stop_above = max(fits - overhead, 2 * overhead)
    if sum(input_chars(item) for item in texts) > _INLINE_TOKENIZE_CHARS:
        # ~100 ms for 64 texts of 2,000 characters: off the event loop, which serves everyone else
        # meanwhile (the tokenizer releases the GIL while it encodes).
        tokens = await asyncio.to_thread(token_counts_off_loop, spec, texts, stop_above)
    else:
        tokens = token_counts(spec, texts, stop_above=stop_above)
    if len(tokens) < len(texts):  # counting stopped early: at least this much, more than fits
        raise Refused(admission.too_large(price(tokens), fits, rate, at_least=True), 0.0)
    return tokens


async def _release_quietly(admission: Admission, model: str, task_id: str) -> None:
    """Release after a broker error; the broker may well still be down, and the caller gets the first error."""
    try:
        await admission.release(model, task_id)
    except Exception:
        pass


def get_admission() -> Admission:
    loop = asyncio.get_running_loop()
    admission = _admissions.get(loop)
    if admission is None:
        admission = Admission(
            get_async_redis(),
            heartbeat_s=settings.WORKER_HEARTBEAT_S,
            rate_window_s=settings.ONLINE_RATE_WINDOW_S,
            headroom=settings.ONLINE_ADMISSION_HEADROOM,
            refusal_hold_s=settings.ONLINE_REFUSAL_HOLD_MS / 1000,
            dispatcher_heartbeat_s=settings.DISPATCHER_HEARTBEAT_S,
            max_backlog_tokens=settings.ONLINE_MAX_BACKLOG_TOKENS,
            client_share=settings.ONLINE_CLIENT_SHARE,
            default_deadline_s=settings.ONLINE_DEADLINE_MS / 1000,
            request_overhead=settings.ONLINE_REQUEST_OVERHEAD_TOKENS,
        )
        _admissions[loop] = admission
    return admission


async def predict(
    spec: ModelSpec,
    texts: list[str],
    deadline_ms: int,
    request_id: str,
    started_at: float,
    *,
    client: str = "",
    client_key: str = "",
    version: str | None = None,
) -> Prediction:
    """Run `texts` through `spec`'s model on the online queue; `started_at` is when the HTTP request arrived.

    The texts are priced in tokens here; `client` is who sent them (fair share and fair order),
    `client_key` how the early refusal path recognises that caller from its headers. `version` is a
    version the caller pinned (checked by versions.check_pin); without one the deployment chooses, per
    caller. Either way the request is stamped with it, and the answer says which version gave it.
    """
    deadline = started_at + deadline_ms / 1000
    admission = get_admission()
    if version is None:
        version = await versions.choose(spec, client)
    # Priced with the chosen version's own tokenizer and limits (a version may override max_seq_length).
    priced = get_registry().version_spec(spec.name, version) or spec
    tokens = await _count_tokens(priced, texts, admission, deadline)
    task_id = uuid.uuid4().hex
    inbox = get_inbox()
    # Expected before it is published: its answer cannot come before anyone listens for it.
    answers = inbox.expect(task_id, get_async_redis(waits=True))
    try:
        admit_start = time.time()
        kwargs = {
            "model": spec.name,
            "inputs": texts,
            "tokens": tokens,
            "client": client,
            "deadline": deadline,
            "enqueued_at": admit_start,
            "request_id": request_id,
            "version": version,
            "reply_to": inbox.key,
        }
        # Admitted and queued in one round trip (the message is built first, and wasted when refused).
        try:
            decision = await admission.admit(
                spec,
                task_id,
                deadline,
                cost=price(tokens),
                client=client,
                client_key=client_key,
                message=task_message(task_id, spec.online_queue, kwargs),
                queue=spec.online_queue,
            )
        except redis.RedisError:
            await _release_quietly(admission, spec.name, task_id)  # admitted or not, it is not counted now
            raise
        admission_ms = (time.time() - admit_start) * 1000
        if not decision.admitted:
            raise Refused(decision, admission_ms)
        observe.admitted_to_version(version)  # a deadline or a failure from here on counts against this version
        try:
            reply = await gather_reply(lambda timeout_s: inbox.next_reply(answers, timeout_s), len(texts), deadline)
        except asyncio.CancelledError:
            # The caller hung up, but its work is still queued and will take the model's time: its tokens
            # stay counted until the worker answers it or its deadline passes (or a send-and-hang-up loop
            # would bypass admission).
            raise
        except BaseException:
            await admission.release(spec.name, task_id)
            raise
        # The worker released the request from the backlog when it wrote the answer (serving.py); an
        # error or a deadline passed without an answer is released here (releasing twice changes nothing).
        if reply is None or not reply["ok"]:
            await admission.release(spec.name, task_id)
        if reply is None:
            raise DeadlineExceeded(deadline_ms, admission_ms)
        if not reply["ok"]:
            raise WorkerFailed(reply["error"], reply.get("code", "worker_failed"))
        now = time.time()
        timing = reply["timing"]
        inference_end = timing.pop("inference_end")
        timing.update(
            admission_ms=round(admission_ms, 3),
            postprocess_ms=round((now - inference_end) * 1000, 3),
            total_ms=round((now - started_at) * 1000, 3),
        )
        return Prediction(
            outputs=reply["outputs"],
            timing=timing,
            worker=reply["worker"],
            tokens=tokens,
            model_version=reply.get("model_version") or version,
        )
    finally:
        inbox.forget(task_id)
