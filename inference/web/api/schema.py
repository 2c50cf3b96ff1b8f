"""OpenAPI description of the predict endpoint, which is an async Django view that DRF cannot introspect.

What each task takes and answers comes from its task type (inference/core/task_types/, gathered by
inference/core/task_io.py): built-in tasks and the plugins the models file names. Their input and output
schemas become named components, and predict's inputs and outputs are `oneOf` them.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from inference.core import task_io
from inference.core.registry import task_types_in_use

_ERROR = {"$ref": "#/components/schemas/Error"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _task_components(max_chars: int, types: list) -> dict[str, dict[str, Any]]:
    """Each task's input and output schema, described with the tasks that take or give it."""
    components: dict[str, dict[str, Any]] = {}
    for name, schema in task_io.input_schemas(max_chars, types).items():
        shape = "a plain string" if name == task_io.TEXT_SCHEMA else "an object with exactly these fields"
        tasks = ", ".join(task_io.tasks_with_schema(name, types))
        components[name] = {**schema, "description": f"An input of a model of task {tasks}: {shape}."}
    for name, schema in task_io.output_schemas(max_chars, types).items():
        tasks = ", ".join(task_io.tasks_with_schema(name, types))
        where = (
            f"The output of a model of task {tasks}." if tasks else schema.get("description", "One item of Entities.")
        )
        components[name] = {**schema, "description": where}
    return components


def _tasks_table(types: list) -> str:
    rows = [f"| `{task}` | {inputs} | {outputs} |" for task, (inputs, outputs) in task_io.task_schemas(types).items()]
    return "\n".join(["| task | each input | each output |", "|---|---|---|", *rows])


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR}}}


def add_predict_endpoint(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: adds POST /api/v1/models/{name}/predict."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = {
        "type": "object",
        "properties": {"detail": {"type": "string"}, "code": {"type": "string"}},
        "required": ["detail", "code"],
    }
    types = task_types_in_use()
    schemas.update(_task_components(settings.ONLINE_MAX_TEXT_CHARS, types))
    input_components = list(task_io.input_schemas(settings.ONLINE_MAX_TEXT_CHARS, types))
    qa_example_output = {"model": "qa", "outputs": [task_io.QA_EXAMPLE_OUTPUT], "timing": {"total_ms": 31.2}}
    stages = [
        "admission_ms",
        "queue_wait_ms",
        "batch_wait_ms",
        "pass_wait_ms",
        "inference_ms",
        "postprocess_ms",
        "total_ms",
    ]
    result.setdefault("paths", {})["/api/v1/models/{name}/predict"] = {
        "post": {
            "operationId": "models_predict",
            "summary": "Run inputs through a model on the online queue",
            "description": (
                "Admitted requests are batched with others on a worker. Responses carry X-Request-ID and "
                "Server-Timing (admission, queue_wait, batch_wait, pass_wait, inference, postprocess, total).\n\n"
                "What each input is and what each output holds depends on the model's task (its `task` "
                "and `input_fields` in GET /api/v1/models); an input of the wrong shape gets a 400 that "
                "names it (`inputs[2] must be an object ...`, `inputs[0].context is empty`).\n\n" + _tasks_table(types)
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
                                    "items": {"oneOf": [_ref(name) for name in input_components]},
                                }
                            },
                        },
                        "examples": {
                            "text": {
                                "summary": "Texts (router, embedding, classification, entities)",
                                "value": {"inputs": ["I was charged twice this month"]},
                            },
                            "question-answering": {
                                "summary": "A question over a context (question-answering)",
                                "value": {"inputs": [task_io.QA_EXAMPLE_INPUT]},
                            },
                        },
                    }
                },
            },
            "responses": {
                "200": {
                    "description": "One output per input, in order; its shape is the model's task's",
                    "content": {
                        "application/json": {
                            "examples": {
                                "question-answering": {
                                    "summary": "An answer and its character offsets in the context",
                                    "value": qa_example_output,
                                }
                            },
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "model": {"type": "string"},
                                    "model_version": {
                                        "type": "string",
                                        "description": "the version of the model that answered (issue 21)",
                                    },
                                    "outputs": {
                                        "type": "array",
                                        "items": {"oneOf": [_ref(name) for name in task_io.output_components(types)]},
                                    },
                                    "timing": {
                                        "type": "object",
                                        "properties": {
                                            **{s: {"type": "number"} for s in stages},
                                            "batch_size": {"type": "integer"},
                                            "batch_requests": {"type": "integer"},
                                        },
                                    },
                                    "worker": {
                                        "type": "string",
                                        "description": "the worker that answered (host:pid); staff callers only",
                                    },
                                },
                            },
                        }
                    },
                },
                "400": _error("Invalid input; the message names the problem"),
                "401": _error("No or invalid credentials"),
                "403": _error(
                    "The API key lacks the predict scope or may not call this model (scope_missing, "
                    "model_not_allowed); a session without its CSRF token (csrf_failed)"
                ),
                "404": _error("Unknown model"),
                "415": _error("Body is not application/json"),
                "429": _error(
                    "Over a quota (rate_limited, daily_tokens_exceeded: `limit` names it) or this client's share "
                    "of the model (client_backlog_full); see Retry-After"
                ),
                "502": _error("The worker failed while running the batch"),
                "503": _error("Refused by admission (backlog_full, deadline, no_worker); see Retry-After"),
                "504": _error("No answer within the deadline"),
            },
        }
    }
    post = result["paths"]["/api/v1/models/{name}/predict"]["post"]
    examples = post["requestBody"]["content"]["application/json"]["examples"]
    for task_type in types:  # a structured plugin task's own example, after the built-ins'
        if not task_type.takes_text and task_type.name not in examples and task_type.input_example() is not None:
            examples[task_type.name] = {
                "summary": f"An input of task {task_type.name}",
                "value": {"inputs": [task_type.input_example()]},
            }
    return result
