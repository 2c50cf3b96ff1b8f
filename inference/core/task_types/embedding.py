"""`embedding`: an L2-normalised vector per text (mean-pooled; also served as OpenAI's /v1/embeddings)."""

from __future__ import annotations

from typing import Any

from inference.core.task_types import TaskType


class EmbeddingTask(TaskType):
    """A vector per text; no label, no score."""

    name = "embedding"
    handler = "inference.child.handlers.embedding:EmbeddingHandler"
    output_schema = "Embedding"

    def schemas(self, max_chars: int) -> dict[str, dict[str, Any]]:
        return {
            "Embedding": {
                "type": "object",
                "properties": {
                    "embedding": {"type": "array", "items": {"type": "number"}, "description": "L2-normalised vector"},
                    "dim": {"type": "integer", "description": "its length"},
                },
                "required": ["embedding", "dim"],
            }
        }
