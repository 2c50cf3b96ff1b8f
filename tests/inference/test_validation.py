"""Predict body checks: each failure names the problem."""

import pytest

from inference.web.validation import parse_deadline_ms, parse_json_body, validate_inputs
from platform_.errors import ApiError

LIMITS = {"max_inputs": 3, "max_chars": 20}


def error_of(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as caught:
        fn(*args, **kwargs)
    return caught.value


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([], "must be a JSON object"),
        ({}, "`inputs` is required"),
        ({"inputs": "hello"}, "must be a list of strings, got a string"),
        ({"inputs": []}, "`inputs` is empty"),
        ({"inputs": ["a", "b", "c", "d"]}, "has 4 texts; the limit is 3"),
        ({"inputs": ["ok", 5]}, "inputs[1] is a number, not a string"),
        ({"inputs": ["ok", None]}, "inputs[1] is null"),
        ({"inputs": ["ok", "   "]}, "inputs[1] is empty"),
        ({"inputs": ["ok", "x" * 21]}, "inputs[1] is 21 characters; the limit is 20"),
    ],
)
def test_bad_inputs_are_named(payload, message):
    error = error_of(validate_inputs, payload, **LIMITS)
    assert error.status == 400
    assert message in error.detail


def test_good_inputs_pass_through():
    assert validate_inputs({"inputs": ["a", "b"]}, **LIMITS) == ["a", "b"]


def test_content_type_and_json():
    assert error_of(parse_json_body, "text/plain", b"{}").status == 415
    error = error_of(parse_json_body, "application/json", b'{"inputs": [')
    assert error.status == 400 and "invalid JSON" in error.detail and "line 1" in error.detail
    assert parse_json_body("application/json; charset=utf-8", b'{"inputs": ["x"]}') == {"inputs": ["x"]}


def test_deadline_header():
    assert parse_deadline_ms(None, 2000) == 2000
    assert parse_deadline_ms("150", 2000) == 150
    assert parse_deadline_ms("99999", 2000) == 2000
    assert "whole number" in error_of(parse_deadline_ms, "soon", 2000).detail
    assert "positive" in error_of(parse_deadline_ms, "0", 2000).detail
