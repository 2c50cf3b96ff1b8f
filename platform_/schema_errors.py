"""drf-spectacular postprocessing hook: the error answers API operations give, documented in the schema.

DRF views document their success shape, but most errors come from shared machinery that
drf-spectacular cannot see: authentication and failed-authentication throttling, the body guard
(platform_/bodies.py: 413), parsers (415), lookups (404), validation (400). They are added here,
once, all with the API's one error shape {"detail", "code"} (platform_/errors.py), so a client
generated from the schema knows every status it may get. A status an operation documents itself
is left as it is.
"""

from __future__ import annotations

from typing import Any

ERROR_SCHEMA = {
    "type": "object",
    "properties": {"detail": {"type": "string"}, "code": {"type": "string"}},
    "required": ["detail", "code"],
}
_UNSAFE = {"post", "put", "patch", "delete"}


# A lookup of a missing object (django.http.Http404) is turned into DRF's NotFound by platform_/errors.py,
# so it carries `code` like every other error.
NOT_FOUND_SCHEMA = {
    "type": "object",
    "properties": {"detail": {"type": "string"}, "code": {"type": "string", "enum": ["not_found"]}},
    "required": ["detail", "code"],
}


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def _errors_for(method: str, operation: dict[str, Any]) -> dict[str, dict[str, Any]]:
    security = operation.get("security")
    authenticated = bool(security) and {} not in security
    parameters = operation.get("parameters", [])
    errors: dict[str, dict[str, Any]] = {}
    if parameters or "requestBody" in operation:
        errors["400"] = _error("the request is invalid; `detail` names the problem")
    if authenticated:
        errors["401"] = _error("no credentials, or a bad token")
        if method in _UNSAFE:
            errors["403"] = _error("a session caller's request without its CSRF token")
    paged = any(p.get("in") == "query" and p.get("name") == "page" for p in parameters)
    if paged or any(p.get("in") == "path" for p in parameters):
        errors["404"] = {
            "description": "no such object, or not yours" + ("; or a page past the last" if paged else ""),
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/NotFound"}}},
        }
    if "requestBody" in operation:
        errors["413"] = _error("the request body is over the size limit")
        errors["415"] = _error("the request body's content type is not one this operation reads")
    if authenticated:
        errors["429"] = _error("too many failed authentications from this address, or a rate limit (see Retry-After)")
    return errors


def add_error_responses(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas.setdefault("Error", ERROR_SCHEMA)
    schemas.setdefault("NotFound", NOT_FOUND_SCHEMA)
    for path, operations in result.get("paths", {}).items():
        if not path.startswith("/api/"):
            continue
        for method, operation in operations.items():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            responses = operation["responses"]
            for status, response in _errors_for(method, operation).items():
                responses.setdefault(status, response)
            for status, response in responses.items():
                if status.startswith("4") and "content" not in response:  # a view's own 4xx, described only
                    response["content"] = _error("")["content"]
    return result
