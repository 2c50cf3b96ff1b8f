"""Checks on a predict request's body, each failure with a message that names the problem."""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

from django.utils.http import parse_header_parameters

from inference.core.registry import RegistryError, get_registry
from inference.core.task_types import _TYPE_NAMES, get_task_type, object_shape
from platform_.errors import ApiError


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

    Each input has `task`'s shape, checked by its task type (inference/core/task_types/): a plain string
    for text tasks (and when `task` is None), else an object with exactly the task's fields (for
    question-answering, each a non-empty string within `max_chars`). `model` is named in the message when
    an input has the wrong shape, and its `options:` reach the task type's check.
    """
    task_type = get_task_type(task or "identity")
    fields = task_type.input_fields
    text_task = task_type.takes_text
    # The texts' messages stay as they were; objects are called inputs.
    noun, kind = ("texts", "strings") if text_task else ("inputs", "objects " + object_shape(fields))
    if not isinstance(payload, dict):
        example = '["text"]' if text_task else f"[{object_shape(fields)}]"
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
    options = _options_of(model) if not text_task else {}
    for index, item in enumerate(inputs):
        task_type.check_input(item, index, max_chars, model, options)
    return inputs


def _options_of(model: str) -> dict[str, Any]:
    """The model's `options:` from the models file ({} for a model it does not list)."""
    try:
        spec = get_registry().get(model)
    except (OSError, RegistryError):
        return {}
    return dict(spec.options) if spec is not None else {}


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
