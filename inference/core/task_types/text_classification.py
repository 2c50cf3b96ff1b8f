"""`text-classification`: a sequence-classification head; its labels are the model config's `id2label`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inference.core.task_types import TaskType

if TYPE_CHECKING:
    from inference.core.registry import ModelSpec

# A classifier's answer (router and text-classification share it).
CLASSIFICATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "description": "the best label"},
        "score": {"type": "number", "description": "its score"},
        "scores": {
            "type": "object",
            "additionalProperties": {"type": "number"},
            "description": "every label's score",
        },
    },
    "required": ["label", "score", "scores"],
    "example": {"label": "billing", "score": 0.66, "scores": {"billing": 0.66, "shipping": 0.21}},
}


class TextClassificationTask(TaskType):
    """A label per text, with every label's probability."""

    name = "text-classification"
    handler = "inference.child.handlers.classification:ClassificationHandler"
    output_schema = "Classification"
    score_help = "the model's probability for the label, from 0 to 1"

    def schemas(self, max_chars: int) -> dict[str, dict[str, Any]]:
        return {"Classification": CLASSIFICATION_SCHEMA}

    def labels(self, spec: ModelSpec) -> list[str]:
        from inference.core.labels import read_labels

        return read_labels(spec.resolved_path() / "config.json", "id2label")
