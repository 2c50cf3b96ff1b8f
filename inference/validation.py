"""Checks on a predict request's body, each failure with a message that names the problem."""

from __future__ import annotations

import json
from typing import Any

from platform_.errors import ApiError

_TYPE_NAMES = {
    dict: "an object",
    list: "a list",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def _invalid(detail: str) -> ApiError:
    return ApiError(400, "invalid_input", detail)


def parse_json_body(content_type: str, body: bytes) -> Any:
    """The decoded JSON body; 415 for another content type, 400 for bytes that are not JSON."""
    media_type = content_type.split(";")[0].strip().lower()
    if media_type != "application/json":
        shown = media_type or "none"
        raise ApiError(415, "unsupported_media_type", f"Content-Type must be application/json, got {shown}")
    try:
        return json.loads(body)
    except UnicodeDecodeError as exc:
        raise _invalid(f"the body is not UTF-8: {exc.reason} at byte {exc.start}") from exc
    except json.JSONDecodeError as exc:
        raise _invalid(f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc


def validate_inputs(payload: Any, *, max_inputs: int, max_chars: int) -> list[str]:
    """The list of texts in `payload["inputs"]`, or a 400 that says what is wrong and where."""
    if not isinstance(payload, dict):
        raise _invalid(
            f'the body must be a JSON object like {{"inputs": ["text"]}}, got {_TYPE_NAMES.get(type(payload), "a string")}'
        )
    if "inputs" not in payload:
        raise _invalid(f"`inputs` is required: a list of 1 to {max_inputs} texts")
    inputs = payload["inputs"]
    if not isinstance(inputs, list):
        raise _invalid(f"`inputs` must be a list of strings, got {_TYPE_NAMES.get(type(inputs), 'a string')}")
    if not inputs:
        raise _invalid(f"`inputs` is empty: send 1 to {max_inputs} texts")
    if len(inputs) > max_inputs:
        raise _invalid(f"`inputs` has {len(inputs)} texts; the limit is {max_inputs} per request")
    for index, text in enumerate(inputs):
        if not isinstance(text, str):
            raise _invalid(f"inputs[{index}] is {_TYPE_NAMES.get(type(text), 'not a string')}, not a string")
        if not text.strip():
            raise _invalid(f"inputs[{index}] is empty")
        if len(text) > max_chars:
            raise _invalid(f"inputs[{index}] is {len(text)} characters; the limit is {max_chars}")
    return inputs


def parse_deadline_ms(header: str | None, default_ms: int) -> int:
    """The client's X-Deadline-Ms if it is shorter than the default; a longer one is capped, not refused."""
    if header is None or header == "":
        return default_ms
    try:
        value = int(header)
    except ValueError:
        raise _invalid(f"X-Deadline-Ms must be a whole number of milliseconds, got {header!r}") from None
    if value <= 0:
        raise _invalid(f"X-Deadline-Ms must be positive, got {value}")
    return min(value, default_ms)
