"""`identity`: no weights; each text's length in characters and tokens (the platform's overhead probe)."""

from __future__ import annotations

from typing import Any

from inference.core.task_types import TaskType


class IdentityTask(TaskType):
    """Answers what admission priced, without a model: measures everything but inference."""

    name = "identity"
    handler = "inference.child.handlers.identity:IdentityHandler"
    output_schema = "Identity"

    def schemas(self, max_chars: int) -> dict[str, dict[str, Any]]:
        return {
            "Identity": {
                "type": "object",
                "properties": {
                    "chars": {"type": "integer", "description": "the text's length in characters"},
                    "tokens": {"type": "integer", "description": "its tokens, as admission priced them"},
                },
                "required": ["chars", "tokens"],
            }
        }
