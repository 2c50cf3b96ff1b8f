"""OpenAPI description of the predict endpoint, which is an async Django view that DRF cannot introspect."""

from __future__ import annotations

from typing import Any

from django.conf import settings

_ERROR = {"$ref": "#/components/schemas/Error"}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR}}}


def add_predict_endpoint(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: adds POST /api/v1/models/{name}/predict."""
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = {
        "type": "object",
        "properties": {"detail": {"type": "string"}, "code": {"type": "string"}},
        "required": ["detail", "code"],
    }
    stages = ["admission_ms", "queue_wait_ms", "batch_wait_ms", "inference_ms", "postprocess_ms", "total_ms"]
    result.setdefault("paths", {})["/api/v1/models/{name}/predict"] = {
        "post": {
            "operationId": "models_predict",
            "summary": "Run texts through a model on the online queue",
            "description": (
                "Admitted requests are batched with others on a worker. Responses carry X-Request-ID and "
                "Server-Timing (admission, queue_wait, batch_wait, inference, postprocess, total)."
            ),
            "tags": ["models"],
            "security": [{"tokenAuth": []}, {"cookieAuth": []}],
            "parameters": [
                {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}},
                {
                    "name": "X-Deadline-Ms",
                    "in": "header",
                    "schema": {"type": "integer", "minimum": 1, "maximum": settings.ONLINE_DEADLINE_MS},
                    "description": "Answer within this many ms or give 504; capped at the server default.",
                },
                {"name": "X-Request-ID", "in": "header", "schema": {"type": "string"}},
            ],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["inputs"],
                            "properties": {
                                "inputs": {
                                    "type": "array",
                                    "minItems": 1,
                                    "maxItems": settings.ONLINE_MAX_INPUTS,
                                    "items": {"type": "string", "maxLength": settings.ONLINE_MAX_TEXT_CHARS},
                                }
                            },
                        },
                        "example": {"inputs": ["I was charged twice this month"]},
                    }
                },
            },
            "responses": {
                "200": {
                    "description": "One output per input, in order",
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "model": {"type": "string"},
                                    "outputs": {"type": "array", "items": {"type": "object"}},
                                    "timing": {
                                        "type": "object",
                                        "properties": {
                                            **{s: {"type": "number"} for s in stages},
                                            "batch_size": {"type": "integer"},
                                            "batch_requests": {"type": "integer"},
                                        },
                                    },
                                    "worker": {"type": "string"},
                                },
                            }
                        }
                    },
                },
                "400": _error("Invalid input; the message names the problem"),
                "401": _error("No or invalid credentials"),
                "404": _error("Unknown model"),
                "415": _error("Body is not application/json"),
                "502": _error("The worker failed while running the batch"),
                "503": _error("Refused by admission (backlog_full, deadline, no_worker); see Retry-After"),
                "504": _error("No answer within the deadline"),
            },
        }
    }
    return result
