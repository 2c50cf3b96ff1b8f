"""Online API: predict (async: waits on Redis, holds no thread), model list, liveness and readiness."""

from __future__ import annotations

import asyncio
import functools
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis
from django.conf import settings
from django.http import JsonResponse
from django.http.cookie import parse_cookie
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.decorators import api_view, authentication_classes, permission_classes
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response

from accounts import quotas, usage
from accounts.credentials import PREDICT
from inference import deployments
from inference.core.keys import DISPATCHERS_KEY, WORKERS_KEY
from inference.core.registry import ModelSpec, get_registry
from inference.core.task_io import input_fields
from inference.core.versions import split_pin
from inference.core.workers import serving_workers
from inference.models import VersionStatus
from inference.web import online, versions
from inference.web.admission import Decision
from inference.web.api.auth import authenticate
from inference.web.observe import observe, version_admitted
from inference.web.validation import parse_deadline_ms, parse_json_body, validate_inputs
from observability.metrics import STAGES
from platform_.errors import ApiError
from platform_.redis import get_redis

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def make_request_id(given: str | None) -> str:
    """The client's X-Request-ID when it is a sane token, else a new one."""
    return given if given and _REQUEST_ID.match(given) else uuid.uuid4().hex


def server_timing(timing: dict[str, Any]) -> str:
    return ", ".join(f"{stage};dur={timing[f'{stage}_ms']:.3f}" for stage in STAGES if f"{stage}_ms" in timing)


async def _predict(request: Any, name: str, request_id: str, started_at: float, seen: dict[str, Any]) -> JsonResponse:
    if request.method != "POST":
        raise ApiError(405, "method_not_allowed", f"use POST, not {request.method}", headers={"Allow": "POST"})
    caller = await authenticate(request)
    caller.require(PREDICT)
    registry = get_registry()
    name, pinned = split_pin(name)  # `router@2`: that version, where it is loaded
    spec = registry.get(name)
    if spec is None:
        raise ApiError(404, "unknown_model", f"unknown model {name!r}; served models: {', '.join(registry.names())}")
    caller.require(PREDICT, name)
    if pinned is not None:
        await versions.check_pin(spec, pinned)
    await quotas.admit(caller.limits)
    user = caller.user
    seen["model"] = name
    payload = await read_json(request)
    texts = validate_inputs(
        payload,
        max_inputs=settings.ONLINE_MAX_INPUTS,
        max_chars=settings.ONLINE_MAX_TEXT_CHARS,
        task=spec.task,
        model=name,
    )
    seen["texts"] = texts
    result = await call_model(
        spec,
        texts,
        deadline_ms_of(request),
        request_id,
        started_at,
        client=str(user.pk),
        caller_key=client_key(request.headers),
        version=pinned,
    )
    seen["timing"], seen["worker"] = result.timing, result.worker
    # Per-version figures (observe.py): the version that answered (issue 21) and the answers' scores.
    seen["version"], seen["outputs"] = getattr(result, "model_version", None), result.outputs
    await usage.record(user.pk, caller.key_id, name, inputs=len(texts), tokens=sum(result.tokens))
    body = {"model": name, "model_version": result.model_version, "outputs": result.outputs, "timing": result.timing}
    if user.is_staff:
        # The worker child that answered (host:pid), for operators tracing a call across hosts. Tenants
        # are not told it: host names and process ids would map the fleet for an attacker.
        body["worker"] = result.worker
    response = JsonResponse(body)
    response["Server-Timing"] = server_timing(result.timing)
    return response


async def read_json(request: Any) -> Any:
    """The request's JSON body, checked as every model call's is (415, depth and number limits: 400).

    A large body can take the parser seconds (millions of small arrays, all within the limits): in a
    thread, the event loop keeps serving other clients meanwhile (it gets the GIL every 5 ms).
    """
    parse = functools.partial(
        parse_json_body,
        request.headers.get("Content-Type", ""),
        request.body,
        max_depth=settings.ONLINE_MAX_JSON_DEPTH,
        max_number_digits=settings.ONLINE_MAX_NUMBER_DIGITS,
    )
    return await asyncio.to_thread(parse) if len(request.body) > _INLINE_PARSE_BYTES else parse()


def deadline_ms_of(request: Any) -> int:
    """The call's deadline: its X-Deadline-Ms (400 when malformed), capped, or the default."""
    return parse_deadline_ms(
        request.headers.get("X-Deadline-Ms"), settings.ONLINE_DEADLINE_MS, settings.ONLINE_MAX_DEADLINE_MS
    )


async def call_model(
    spec: ModelSpec,
    texts: list[str],
    deadline_ms: int,
    request_id: str,
    started_at: float,
    *,
    client: str,
    caller_key: str,
    version: str | None = None,
) -> online.Prediction:
    """online.predict, its refusals and failures raised as the API's errors: shared by predict and
    the OpenAI-compatible embeddings (inference/web/api/openai_compat.py), which reshapes them.
    `version`: a version the caller pinned (None: the deployment chooses)."""
    try:
        return await online.predict(
            spec, texts, deadline_ms, request_id, started_at, client=client, client_key=caller_key, version=version
        )
    except online.Refused as refused:
        if refused.decision.status == 413 and _repeats_too_large(caller_key):
            # The same caller resending what cannot fit: answered later, so its loop costs the web
            # tier (and so the model's cores) one parse and count a delay, not one per round trip.
            await asyncio.sleep(settings.ONLINE_REFUSAL_DELAY_MS / 1000)
        raise _refusal(spec.name, refused.decision, refused.admission_ms) from None
    except online.DeadlineExceeded as exc:
        raise ApiError(
            504,
            "deadline_exceeded",
            f"no answer within the deadline of {exc.deadline_ms} ms; the request was dropped",
            timing={"admission_ms": round(exc.admission_ms, 3)},
        ) from None
    except online.WorkerFailed as exc:
        # input_rejected: the model failed on this request's own input, run apart from its neighbours.
        # version_not_loaded: pinned to a version the child that took it lacks (heartbeats lag a moment).
        status = {"input_rejected": 422, "version_not_loaded": 409}.get(exc.code, 502)
        raise ApiError(status, exc.code, str(exc)) from None
    except redis.RedisError as exc:
        raise ApiError(
            503, "broker_unavailable", f"the broker is unreachable: {exc}", headers={"Retry-After": "1"}
        ) from None


# Bodies larger than this are parsed in a thread (a 64-text request of short texts is a few KB).
_INLINE_PARSE_BYTES = 64 * 1024
_too_large_at: dict[str, float] = {}  # caller -> when it was last told 413 (bounded, see below)


def _repeats_too_large(key: str) -> bool:
    """Whether this caller was told 413 within the last second (and remember that it is now)."""
    now = time.monotonic()
    repeat = now - _too_large_at.get(key, -1e9) < 1.0
    if len(_too_large_at) > 10_000:
        _too_large_at.clear()
    _too_large_at[key] = now
    return repeat


def _refusal(name: str, decision: Decision, admission_ms: float) -> ApiError:
    # 413 (too large for any deadline) is not worth retrying as it is, so it carries no Retry-After.
    headers = {"Retry-After": str(decision.retry_after_s)} if decision.status != 413 else {}
    return ApiError(
        decision.status,
        decision.reason or "refused",
        decision.message(name),
        headers=headers,
        backlog=decision.backlog,
        limit=decision.limit,
        cost_tokens=decision.cost,
        timing={"admission_ms": round(admission_ms, 3)},
    )


def client_key(headers: Any) -> str:
    """How the early refusal recognises a caller from its headers alone: its credentials, unchecked.

    Only ever used to repeat a refusal this caller itself just got, so a forged value gains nothing.
    """
    authorization = headers.get("authorization") or headers.get("Authorization")
    if authorization:
        # "Token k", "Bearer k" and extra spaces are the same caller: one key, one hold.
        return authorization.strip().rpartition(" ")[2]
    cookies = parse_cookie(headers.get("cookie") or headers.get("Cookie") or "")
    session = cookies.get(settings.SESSION_COOKIE_NAME)
    return f"session:{session}" if session else ""


def early_refusal(request_headers: dict[str, str], name: str) -> JsonResponse | None:
    """503 for a predict call before its body is read or its caller authenticated, when this web
    process has just refused the same model for a request no more patient (Admission.held_refusal).

    Under overload most calls end here, at a fraction of a full refusal's CPU. A caller with a bad
    token or body gets the 503 (with Retry-After) now and its 401 or 400 when it comes back.
    """
    started_at = time.time()
    if get_registry().get(name) is None:
        return None
    try:
        deadline_ms = parse_deadline_ms(
            request_headers.get("x-deadline-ms"), settings.ONLINE_DEADLINE_MS, settings.ONLINE_MAX_DEADLINE_MS
        )
    except ApiError:
        return None  # the full path explains the bad header
    decision = online.get_admission().held_refusal(name, client_key(request_headers), deadline_ms)
    if decision is None:
        return None
    error = _refusal(name, decision, 0.0)
    request_id = make_request_id(request_headers.get("x-request-id"))
    timing = {"admission_ms": 0.0, "total_ms": (time.time() - started_at) * 1000}
    observe(model=name, status=error.status, code=error.code, timing=timing, request_id=request_id, texts=[])
    response = error.response()
    response["Server-Timing"] = server_timing(timing)
    # A caller refused again within the hold is retrying without waiting: answering it later (never
    # later than its Retry-After) caps what a retry storm costs the web tier, and so the model.
    response.delay_s = min(settings.ONLINE_REFUSAL_DELAY_MS / 1000, decision.retry_after_s)
    return finish_response(response, request_id)


def finish_response(response: JsonResponse, request_id: str) -> JsonResponse:
    response["X-Request-ID"] = request_id
    response["X-Content-Type-Options"] = "nosniff"  # SecurityMiddleware's header; predict skips middleware
    return response


async def serve_observed(
    request: Any,
    handle: Callable[[str, float, dict[str, Any]], Awaitable[JsonResponse]],
    shape_error: Callable[[ApiError], ApiError] = lambda error: error,
) -> JsonResponse:
    """Run `handle(request_id, started_at, seen)` for a model call and answer it as every model call is
    answered: an ApiError becomes its response (in the endpoint's shape, `shape_error`), with
    Server-Timing; the call is recorded (metrics, slow-request log) and X-Request-ID set."""
    started_at = time.time()
    request_id = make_request_id(request.headers.get("X-Request-ID"))
    seen: dict[str, Any] = {"model": "-", "texts": [], "timing": {}, "worker": ""}
    code = None
    try:
        response = await handle(request_id, started_at, seen)
    except ApiError as raised:
        error = shape_error(raised)
        response, code = error.response(), error.code
        seen["timing"] = {**error.extra.get("timing", {}), "total_ms": (time.time() - started_at) * 1000}
        response["Server-Timing"] = server_timing(seen["timing"])
    observe(
        model=seen["model"],
        status=response.status_code,
        code=code,
        timing=seen["timing"],
        request_id=request_id,
        texts=seen["texts"],
        worker=seen["worker"],
        version=seen.get("version") or version_admitted(),  # no answer: the version it was admitted to
        outputs=seen.get("outputs"),
    )
    return finish_response(response, request_id)


@csrf_exempt  # token callers send no cookie; session callers are CSRF-checked in authenticate()
async def predict_view(request: Any, name: str) -> JsonResponse:
    """POST /api/v1/models/<name>/predict: documented in the OpenAPI schema by inference/web/api/schema.py."""
    return await serve_observed(request, functools.partial(_predict, request, name))


def _serving_workers() -> list[dict[str, Any]]:
    """Worker children alive whose dispatching main process is alive too."""
    client = get_redis()
    return serving_workers(
        client.hgetall(WORKERS_KEY),
        client.hgetall(DISPATCHERS_KEY),
        settings.WORKER_HEARTBEAT_S,
        settings.DISPATCHER_HEARTBEAT_S,
    )


_model_list = inline_serializer(
    "ModelList",
    fields={
        "default": serializers.CharField(),
        "models": serializers.ListField(
            child=inline_serializer(
                "ServedModel",
                fields={
                    "name": serializers.CharField(),
                    "task": serializers.CharField(),
                    "input_fields": serializers.ListField(
                        child=serializers.CharField(),
                        help_text='["text"]: each input is a string; else an object with these fields',
                    ),
                    "max_batch_size": serializers.IntegerField(),
                    "max_seq_length": serializers.IntegerField(),
                    "device": serializers.CharField(),
                    "max_backlog": serializers.IntegerField(),
                    "queue": serializers.CharField(),
                    "served": serializers.BooleanField(),
                    "online_workers": serializers.IntegerField(),
                    "active_version": serializers.CharField(),
                    "target_version": serializers.CharField(allow_null=True, help_text="promoted, loading"),
                    "previous_version": serializers.CharField(allow_null=True, help_text="what a rollback promotes"),
                    "canary_version": serializers.CharField(allow_null=True),
                    "canary_percent": serializers.FloatField(),
                    "versions": serializers.ListField(
                        child=inline_serializer(
                            "ModelVersion",
                            fields={
                                "version": serializers.CharField(),
                                "status": serializers.ChoiceField(choices=VersionStatus.values),
                                "active": serializers.BooleanField(),
                                "canary": serializers.BooleanField(),
                                "loaded_workers": serializers.IntegerField(help_text="live children with it loaded"),
                            },
                        )
                    ),
                },
            )
        ),
    },
)


# HEAD as well (GET without the body, which the server drops): monitors and load balancers probe with it,
# and DRF's api_view allows only the methods it is given.
@extend_schema(responses=_model_list, summary="Served models and whether an online worker serves each")
@api_view(["GET", "HEAD"])
def model_list(request: Request) -> Response:
    registry = get_registry()
    workers = _serving_workers()
    listing = deployments.version_listing(registry, workers, staff=request.user.is_staff)
    models = []
    for name in registry.names():
        spec = registry.models[name]
        children = [w for w in workers if w["queue"] == "online" and name in w["models"]]
        models.append(
            {
                "name": name,
                "task": spec.task,
                # ["text"]: inputs are plain strings; else objects with these fields (task_io.py).
                "input_fields": list(input_fields(spec.task)),
                "max_batch_size": spec.max_batch_size,
                "max_seq_length": spec.max_seq_length,
                "device": spec.device,
                "max_backlog": spec.max_backlog,
                "queue": spec.online_queue,
                "served": bool(children),
                "online_workers": len(children),
                **listing[name],
            }
        )
    return Response({"default": registry.default, "models": models})


@extend_schema(responses=inline_serializer("Health", fields={"status": serializers.CharField()}))
@api_view(["GET", "HEAD"])
@authentication_classes([])
@permission_classes([AllowAny])
def health(request: Request) -> Response:
    """Liveness: the web process answers."""
    return Response({"status": "ok"})


@extend_schema(
    responses=inline_serializer("Ready", fields={"status": serializers.CharField(), "checks": serializers.DictField()})
)
@api_view(["GET", "HEAD"])
@authentication_classes([])
@permission_classes([AllowAny])
def ready(request: Request) -> Response:
    """Readiness: the broker answers and at least one online worker child is alive."""
    checks: dict[str, Any] = {}
    try:
        get_redis().ping()
        checks["broker"] = "ok"
        online_children = [w for w in _serving_workers() if w["queue"] == "online"]
        checks["online_workers"] = len(online_children)
    except redis.RedisError as exc:
        checks["broker"] = f"unreachable: {exc}"
        online_children = []
    ok = checks["broker"] == "ok" and bool(online_children)
    return Response({"status": "ready" if ok else "not ready", "checks": checks}, status=200 if ok else 503)
