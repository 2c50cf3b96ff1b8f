"""Checks on a predict request's body, each failure with a message that names the problem."""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

from django.utils.http import parse_header_parameters

from inference.core import task_io
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


_WHOLE_NUMBER = re.compile(r"\s*-?[0-9]{1,12}\s*")
# Opening brackets become 1, closing ones -1 (as signed bytes), everything else is dropped.
_DEPTH_TABLE = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[{]}")


def json_depth(body: bytes) -> int:
    """Deepest nesting of arrays and objects, estimated on the raw bytes (brackets inside strings
    count too; what this misses, the parser's own recursion limit catches, also as a 400). The loop
    runs in C (accumulate over a memoryview of signed bytes): ~50 ns a bracket, and a body with
    fewer brackets than the limit is never scanned."""
    steps = memoryview(body.translate(_DEPTH_TABLE, delete=_NOT_BRACKETS)).cast("b")
    return max(accumulate(steps), default=0)


def parse_json_body(content_type: str, body: bytes, *, max_depth: int = 32, max_number_digits: int = 64) -> Any:
    """The decoded JSON body; 415 for another content type, 400 for bytes that are not JSON, or JSON
    nested deeper than `max_depth` or holding an integer longer than `max_number_digits`.

    Python's parser recurses once per level and converts integers of any length (quadratic time,
    and a ValueError past 4,300 digits), so both are bounded before they can cost more than a 400.
    """
    media_type, params = parse_header_parameters(content_type)
    if media_type != "application/json":
        shown = media_type or "none"
        raise ApiError(415, "unsupported_media_type", f"Content-Type must be application/json, got {shown}")
    charset = params.get("charset", "utf-8").lower()
    if charset not in ("utf-8", "utf8"):
        raise ApiError(
            415, "unsupported_media_type", f"JSON must be sent as UTF-8 (charset=utf-8), got charset={charset}"
        )
    # Cheap test first: a body with few brackets cannot be deep.
    if body.count(b"[") + body.count(b"{") > max_depth and (depth := json_depth(body)) > max_depth:
        raise _invalid(f"the JSON is nested {depth} levels deep; the limit is {max_depth}")

    def parse_int(digits: str) -> int:
        if len(digits.lstrip("-")) > max_number_digits:
            raise _invalid(f"the JSON holds a number of {len(digits)} digits; the limit is {max_number_digits}")
        return int(digits)

    try:
        return json.loads(body, parse_int=parse_int)
    except UnicodeDecodeError as exc:
        raise _invalid(f"the body is not UTF-8: {exc.reason} at byte {exc.start}") from exc
    except json.JSONDecodeError as exc:
        raise _invalid(f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    except RecursionError:
        raise _invalid(f"the JSON is nested too deep; the limit is {max_depth} levels") from None


def validate_inputs(
    payload: Any, *, max_inputs: int, max_chars: int, task: str | None = None, model: str = ""
) -> list[Any]:
    """The inputs in `payload["inputs"]`, or a 400 that says what is wrong and where.

    Each input has `task`'s shape (inference/core/task_io.py): a plain string for text tasks (and when
    `task` is None), else an object with exactly the task's fields, each a non-empty string within
    `max_chars`. `model` is named in the message when an input has the wrong shape.
    """
    fields = ("text",) if task is None else task_io.input_fields(task)
    text_task = fields == ("text",)
    # The texts' messages stay as they were; objects are called inputs.
    noun, kind = ("texts", "strings") if text_task else ("inputs", "objects " + _object_shape(fields))
    if not isinstance(payload, dict):
        example = '["text"]' if text_task else f"[{_object_shape(fields)}]"
        raise _invalid(
            f'the body must be a JSON object like {{"inputs": {example}}}, got {_TYPE_NAMES.get(type(payload), "a string")}'
        )
    if "inputs" not in payload:
        raise _invalid(f"`inputs` is required: a list of 1 to {max_inputs} {noun}")
    inputs = payload["inputs"]
    if not isinstance(inputs, list):
        raise _invalid(f"`inputs` must be a list of {kind}, got {_TYPE_NAMES.get(type(inputs), 'a string')}")
    if not inputs:
        raise _invalid(f"`inputs` is empty: send 1 to {max_inputs} {noun}")
    if len(inputs) > max_inputs:
        raise _invalid(f"`inputs` has {len(inputs)} {noun}; the limit is {max_inputs} per request")
    for index, item in enumerate(inputs):
        if text_task:
            if not isinstance(item, str):
                raise _invalid(f"inputs[{index}] is {_TYPE_NAMES.get(type(item), 'not a string')}, not a string")
            _check_text(item, f"inputs[{index}]", max_chars)
        else:
            _check_object(item, index, fields, max_chars, task, model)
    return inputs


def _object_shape(fields: tuple[str, ...]) -> str:
    """How an object input is written in messages: {"question": ..., "context": ...}."""
    return "{" + ", ".join(f'"{name}": ...' for name in fields) + "}"


def _check_object(item: Any, index: int, fields: tuple[str, ...], max_chars: int, task: str | None, model: str) -> None:
    where = f"inputs[{index}]"
    if not isinstance(item, dict):
        got = _TYPE_NAMES.get(type(item), "a string")
        raise _invalid(
            f"{where} must be an object {_object_shape(fields)} for model {model!r} (task {task}), got {got}"
        )
    expected = ", ".join(fields)
    for name in item:
        if name not in fields:
            shown = repr(name) if len(name) <= 40 else f"{name[:40]!r}... ({len(name)} characters)"
            raise _invalid(f"{where} has unknown field {shown}; expected {expected}")
    for name in fields:
        if name not in item:
            raise _invalid(f"{where} has no field {name!r}; expected {expected}")
        value = item[name]
        if not isinstance(value, str):
            raise _invalid(f"{where}.{name} is {_TYPE_NAMES.get(type(value), 'not a string')}, not a string")
        _check_text(value, f"{where}.{name}", max_chars)


def _check_text(text: str, where: str, max_chars: int) -> None:
    if not text.strip():
        raise _invalid(f"{where} is empty")
    if len(text) > max_chars:
        raise _invalid(f"{where} is {len(text)} characters; the limit is {max_chars}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800"): valid JSON, but not text
        raise _invalid(f"{where} is not valid Unicode text: {exc.reason} at character {exc.start}") from None


def parse_deadline_ms(header: str | None, default_ms: int, max_ms: int | None = None) -> int:
    """The client's X-Deadline-Ms, up to `max_ms` (default: `default_ms`); a longer one is capped, not refused."""
    if header is None or header == "":
        return default_ms
    if not _WHOLE_NUMBER.fullmatch(header):
        raise _invalid(f"X-Deadline-Ms must be a whole number of milliseconds, got {header[:40]!r}")
    value = int(header)
    if value <= 0:
        raise _invalid(f"X-Deadline-Ms must be positive, got {value}")
    return min(value, max_ms or default_ms)
