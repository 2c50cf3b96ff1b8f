"""`token-classification`: entities (persons, places, ...) found in a text, with character offsets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inference.core.task_types import ExportColumn, TaskType


def _entities(output: Mapping[str, Any] | None) -> list:
    return (output or {}).get("entities") or []


def _entities_text(inputs: Mapping[str, Any], output: Mapping[str, Any] | None) -> str:
    """Entities as a person reads them: "PER: Ada Lovelace; LOC: London"."""
    return "; ".join(f"{e.get('label', '')}: {e.get('text', '')}" for e in _entities(output) if isinstance(e, dict))


class TokenClassificationTask(TaskType):
    """Entities per text; a row has no single score (each entity carries its own)."""

    name = "token-classification"
    handler = "inference.child.handlers.token_classification:TokenClassificationHandler"
    output_schema = "Entities"
    answer_heading = "Entities"
    export_columns = (
        "text",
        "status",
        ExportColumn("entities", _entities_text),
        ExportColumn("entity_count", lambda inputs, output: "" if output is None else str(len(_entities(output)))),
        ExportColumn("truncated", lambda inputs, output: "yes" if (output or {}).get("truncated") else ""),
    )

    def schemas(self, max_chars: int) -> dict[str, dict[str, Any]]:
        return {
            "Entity": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "description": "the entity's type (PER, ORG, LOC, ...)"},
                    "text": {"type": "string", "description": "as written in the input: input[start:end]"},
                    "start": {"type": "integer"},
                    "end": {"type": "integer"},
                    "score": {"type": "number"},
                },
                "required": ["label", "text", "start", "end", "score"],
            },
            "Entities": {
                "type": "object",
                "properties": {
                    "entities": {"type": "array", "items": {"$ref": "#/components/schemas/Entity"}},
                    "truncated": {
                        "type": "boolean",
                        "description": "the text was cut at max_seq_length tokens: entities past that point were not looked for",
                    },
                },
                "required": ["entities", "truncated"],
            },
        }
