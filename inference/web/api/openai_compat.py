"""OpenAI-compatible embeddings: `POST /v1/embeddings` and `GET /v1/models`, for OpenAI clients
pointed at this platform (`OpenAI(base_url="<host>/v1", api_key=<API token>)`).

A call is served exactly as a predict call on an embedding model is: the same authentication
(`Bearer <key>` is the same DRF token as `Token <key>`), the same input limits (inference/web/validation.py),
and the same admission, fair share and batching (`views.call_model`, i.e. `online.predict`), so an
OpenAI client and a predict client of the same user share one share of the model. What differs is
the wire format: OpenAI's request fields, its `{"object": "list", "data": [...], "usage": ...}`
answer, and its error shape `{"error": {"message", "type", "param", "code"}}`, which OpenAI's
clients turn into their typed exceptions by status code.

The request parsing and response shaping are plain functions (`parse_embeddings_request`,
`embeddings_body`, `model_list_body`, `openai_error`); the views only wire them to HTTP.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import struct
from dataclasses import dataclass
from functools import cache
from typing import Any

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.urls import path, re_path
from django.views.decorators.csrf import csrf_exempt

from accounts import quotas, usage
from accounts.credentials import EMBEDDINGS
from inference.core.registry import ModelSpec, Registry, get_registry
from inference.core.versions import split_pin
from inference.web import versions
from inference.web.api.auth import authenticate
from inference.web.api.views import (
    call_model,
    client_key,
    deadline_ms_of,
    finish_response,
    make_request_id,
    read_json,
    serve_observed,
    server_timing,
)
from inference.web.validation import validate_inputs
from platform_.errors import ApiError

EMBEDDING_TASK = "embedding"
ENCODING_FORMATS = ("float", "base64")
# Every field of OpenAI's embeddings request; anything else is refused by name, as OpenAI does.
REQUEST_FIELDS = ("input", "model", "encoding_format", "dimensions", "user")
OWNED_BY = "inference-platform"


class OpenAIError(ApiError):
    """An error answered in OpenAI's shape; `type` is what OpenAI calls the class of error."""

    def __init__(
        self,
        status: int,
        code: str | None,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002  (OpenAI's field name)
        param: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(status, code or "", message, headers=headers, **extra)
        self.type, self.param, self.openai_code = type, param, code

    def response(self) -> JsonResponse:
        body = {"message": self.detail, "type": self.type, "param": self.param, "code": self.openai_code}
        response = JsonResponse({"error": body}, status=self.status)
        for name, value in self.headers.items():
            response[name] = value
        return response


def _error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status == 403:
        return "permission_error"
    return "server_error" if status >= 500 else "invalid_request_error"


_INPUTS_WORD = re.compile(r"\binputs\b")


def openai_error(error: ApiError, *, param: str | None = None) -> OpenAIError:
    """The platform's error (`{"detail", "code"}`) as OpenAI's, same status and headers (Retry-After).

    The platform's `code` is kept (`backlog_full`, `client_backlog_full`, `deadline_exceeded`, ...):
    it says which limit refused the call, which OpenAI's generic codes would not. 401 is the
    exception: OpenAI's clients and users know it as `invalid_api_key`. `param="input"` also renames
    predict's field in the message (`inputs[3] is empty` -> `input[3] is empty`).
    """
    if isinstance(error, OpenAIError):
        return error
    message = error.detail
    if param == "input":
        message = _INPUTS_WORD.sub("input", message)
    code = "invalid_api_key" if error.status == 401 else error.code
    timing = error.extra.get("timing")
    extra = {"timing": timing} if timing is not None else {}
    return OpenAIError(
        error.status, code, message, type=_error_type(error.status), param=param, headers=error.headers, **extra
    )


def _invalid(message: str, param: str | None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, code, message, param=param)


@dataclass(frozen=True)
class EmbeddingsRequest:
    """A checked `POST /v1/embeddings` body."""

    spec: ModelSpec
    texts: list[str]
    encoding_format: str  # "float" or "base64"


def embedding_models(registry: Registry) -> list[str]:
    return [name for name in registry.names() if registry.models[name].task == EMBEDDING_TASK]


@cache
def model_dimension(spec: ModelSpec) -> int | None:
    """The length of the model's vectors without loading it: the embedding handler mean-pools the
    last hidden state, so it is the transformer's hidden_size (None when its config does not say)."""
    try:
        with open(spec.resolved_path() / "config.json", encoding="utf-8") as handle:
            size = json.load(handle).get("hidden_size")
    except (OSError, ValueError):
        return None
    return size if isinstance(size, int) else None


def _embedding_spec(registry: Registry, model: Any) -> ModelSpec:
    """The served embedding model named `model`: 404 for an unknown one, 400 for one of another task."""
    served = ", ".join(embedding_models(registry)) or "none"
    if not isinstance(model, str) or not model:
        raise _invalid(f"`model` must be the name of an embedding model; served here: {served}", "model")
    spec = registry.get(model)
    if spec is None:
        raise OpenAIError(
            404,
            "model_not_found",
            f"The model `{model}` does not exist; embedding models served here: {served}",
            param="model",
        )
    if spec.task != EMBEDDING_TASK:
        raise _invalid(
            f"The model `{model}` is a {spec.task} model, not an embedding model; embedding models served here: {served}",
            "model",
            code="model_not_supported",
        )
    return spec


def _texts(raw: Any, spec: ModelSpec, *, max_inputs: int, max_chars: int) -> list[str]:
    """`input` as a list of texts, under predict's limits (and its messages, about `input`)."""
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list):
        raise _invalid("`input` must be a string or a list of strings", "input", code="invalid_type")
    # OpenAI also takes token ids ([1, 2] or [[1, 2], [3]]); this platform tokenizes with each model's
    # own tokenizer, so ids from another one (tiktoken's) would mean nothing to it.
    if any(isinstance(item, list) or (isinstance(item, int) and not isinstance(item, bool)) for item in raw):
        raise _invalid(
            "token-id arrays are not supported as `input`: send the texts as strings "
            "(LangChain: OpenAIEmbeddings(check_embedding_ctx_length=False))",
            "input",
            code="unsupported_value",
        )
    try:
        return validate_inputs(
            {"inputs": raw}, max_inputs=max_inputs, max_chars=max_chars, task=spec.task, model=spec.name
        )
    except ApiError as error:
        raise openai_error(error, param="input") from None


def parse_embeddings_request(payload: Any, registry: Registry, *, max_inputs: int, max_chars: int) -> EmbeddingsRequest:
    """A decoded JSON body checked against OpenAI's embeddings request and this platform's limits."""
    if not isinstance(payload, dict):
        raise _invalid('the body must be a JSON object like {"model": "embedding", "input": ["text"]}', None)
    for name in payload:
        if name not in REQUEST_FIELDS:
            raise _invalid(
                f"Unrecognized request argument supplied: {name} (supported: {', '.join(REQUEST_FIELDS)})",
                name,
                code="unknown_parameter",
            )
    if "model" not in payload:
        raise _invalid("you must provide a `model` parameter", "model", code="missing_required_parameter")
    spec = _embedding_spec(registry, payload["model"])
    if "input" not in payload:
        raise _invalid("you must provide an `input` parameter", "input", code="missing_required_parameter")
    texts = _texts(payload["input"], spec, max_inputs=max_inputs, max_chars=max_chars)
    # Left out or null means the default; any other value must be one of the formats (0, "" and false too).
    encoding_format = payload.get("encoding_format")
    if encoding_format is None:
        encoding_format = "float"
    if not isinstance(encoding_format, str) or encoding_format not in ENCODING_FORMATS:
        raise _invalid(
            f"`encoding_format` must be one of {', '.join(ENCODING_FORMATS)}, got {str(encoding_format)[:40]!r}",
            "encoding_format",
        )
    dimensions = payload.get("dimensions")
    if dimensions is not None:
        # Vectors are never truncated (MiniLM's are not trained to be): the only size is the model's.
        native = model_dimension(spec)
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions != native:
            shown = f"{native}" if native is not None else "its own (unknown here)"
            raise _invalid(
                f"`dimensions` can only be the model's own dimension, {shown}, for `{spec.name}`; got {dimensions!r}",
                "dimensions",
                code="unsupported_value",
            )
    user = payload.get("user")
    if user is not None and not isinstance(user, str):
        raise _invalid("`user` must be a string", "user", code="invalid_type")
    return EmbeddingsRequest(spec=spec, texts=texts, encoding_format=encoding_format)


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """`float`: the list itself; `base64`: its little-endian float32 bytes, what OpenAI's clients decode."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def embeddings_body(model: str, outputs: list[dict[str, Any]], tokens: list[int], encoding_format: str) -> dict:
    """OpenAI's embeddings answer; usage counts the tokens the model saw (after truncation)."""
    total = sum(tokens)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": index, "embedding": encode_vector(output["embedding"], encoding_format)}
            for index, output in enumerate(outputs)
        ],
        "model": model,
        "usage": {"prompt_tokens": total, "total_tokens": total},
    }


def _created(spec: ModelSpec) -> int:
    """When the weights were written (their config file's time): a stable `created` for OpenAI's model object."""
    try:
        return int((spec.resolved_path() / "config.json").stat().st_mtime)
    except OSError:
        return 0


def model_object(spec: ModelSpec) -> dict[str, Any]:
    return {"id": spec.name, "object": "model", "created": _created(spec), "owned_by": OWNED_BY}


def model_list_body(registry: Registry) -> dict[str, Any]:
    """OpenAI's model list: the embedding models only, the only ones this API serves."""
    return {"object": "list", "data": [model_object(registry.models[name]) for name in embedding_models(registry)]}


# --- views: HTTP in, the functions above, HTTP out ------------------------------------------------


def _method(request: HttpRequest, allowed: str) -> None:
    # A GET answers HEAD too (the server drops the body): monitors and load balancers probe with it.
    methods = (allowed, "HEAD") if allowed == "GET" else (allowed,)
    if request.method not in methods:
        detail = f"use {allowed}, not {request.method}"
        raise OpenAIError(405, "method_not_allowed", detail, headers={"Allow": ", ".join(methods)})


async def _embeddings(request: HttpRequest, request_id: str, started_at: float, seen: dict[str, Any]) -> JsonResponse:
    _method(request, "POST")
    caller = await authenticate(request)
    caller.require(EMBEDDINGS)
    await quotas.admit(caller.limits)
    payload = await read_json(request)
    pinned = None
    if isinstance(payload, dict) and isinstance(payload.get("model"), str):
        # `embedding@2`: that version, where it is loaded (as predict's model@version).
        name, pinned = split_pin(payload["model"])
        payload = {**payload, "model": name}
    checked = parse_embeddings_request(
        payload, get_registry(), max_inputs=settings.ONLINE_MAX_INPUTS, max_chars=settings.ONLINE_MAX_TEXT_CHARS
    )
    caller.require(EMBEDDINGS, checked.spec.name)
    seen["model"], seen["texts"] = checked.spec.name, checked.texts
    deadline_ms = deadline_ms_of(request)
    try:
        if pinned is not None:
            await versions.check_pin(checked.spec, pinned)
        result = await call_model(
            checked.spec,
            checked.texts,
            deadline_ms,
            request_id,
            started_at,
            client=str(caller.user.pk),
            caller_key=client_key(request.headers),
            version=pinned,
        )
    except ApiError as error:
        # The tokenizer's 400 names a text (inputs[i]); refusals and failures name no field.
        raise openai_error(error, param="input" if error.code == "invalid_input" else None) from None
    seen["timing"], seen["worker"] = result.timing, result.worker
    seen["version"] = result.model_version  # the per-version figures count embeddings calls too
    await usage.record(
        caller.user.pk, caller.key_id, checked.spec.name, inputs=len(checked.texts), tokens=sum(result.tokens)
    )
    body = embeddings_body(checked.spec.name, result.outputs, result.tokens, checked.encoding_format)
    # Not in OpenAI's schema: an extra field its clients ignore, which says which version answered (issue 21).
    body["model_version"] = result.model_version
    response = JsonResponse(body)
    response["Server-Timing"] = server_timing(result.timing)
    return response


@csrf_exempt  # token callers send no cookie; session callers are CSRF-checked in authenticate()
async def embeddings_view(request: HttpRequest) -> JsonResponse:
    """POST /v1/embeddings: OpenAI's embeddings endpoint, served like predict (X-Request-ID,
    X-Deadline-Ms, Server-Timing, metrics and the slow-request log included)."""
    return await serve_observed(request, functools.partial(_embeddings, request), shape_error=openai_error)


async def _answer(request: HttpRequest, body: Any) -> JsonResponse:
    """A GET answered in OpenAI's shape: `body()` once the caller is authenticated, errors as OpenAI's."""
    try:
        _method(request, "GET")
        await authenticate(request)
        response = JsonResponse(body())
    except ApiError as error:
        response = openai_error(error).response()
    return finish_response(response, make_request_id(request.headers.get("X-Request-ID")))


@csrf_exempt  # GET only: any other method is a 405 in OpenAI's shape, not the CSRF 403 of a session
async def models_view(request: HttpRequest) -> JsonResponse:
    """GET /v1/models: the embedding models, as OpenAI clients list them before they call."""
    return await _answer(request, lambda: model_list_body(get_registry()))


def _listed_model(model: str) -> dict[str, Any]:
    """One model of the list; any other name is not found, as the list does not show it either."""
    try:
        return model_object(_embedding_spec(get_registry(), model))
    except OpenAIError as error:
        raise OpenAIError(404, "model_not_found", error.detail, param="model") from None


@csrf_exempt  # GET only: any other method is a 405 in OpenAI's shape, not the CSRF 403 of a session
async def model_view(request: HttpRequest, model: str) -> JsonResponse:
    """GET /v1/models/<model>: one embedding model (404 for any other name)."""
    return await _answer(request, lambda: _listed_model(model))


@csrf_exempt
async def unsupported_view(request: HttpRequest, rest: str) -> JsonResponse:
    """Any other /v1/ path: a 404 in OpenAI's shape that says what is served (not the site's HTML page)."""
    error = OpenAIError(
        404,
        "unknown_url",
        f"Unrecognized request URL ({request.method} /v1/{rest}); this server implements only "
        "POST /v1/embeddings, GET /v1/models, /v1/files and /v1/batches of the OpenAI API",
    )
    return finish_response(error.response(), make_request_id(request.headers.get("X-Request-ID")))


# Included under v1/ by platform_/urls.py.
urlpatterns = [
    path("embeddings", embeddings_view, name="openai-embeddings"),
    path("models", models_view, name="openai-models"),
    path("models/<str:model>", model_view, name="openai-model"),
    re_path(r"^(?P<rest>.*)$", unsupported_view),
]
