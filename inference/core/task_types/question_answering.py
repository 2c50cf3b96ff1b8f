"""`question-answering`: the part of a context that answers a question, with its character offsets.

Its inputs are objects {"question", "context"}; a job reads a question column and a context column. A
model answers by `qa_method` (models file): "span" (an extractive head over overlapping windows of
`doc_stride` shared tokens) or "sentence" (the context's sentence closest to the question). What one
input costs is what its handler runs: every window or every sentence (inference/core/tokens.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from inference.core import task_io
from inference.core.task_types import ExportColumn, TaskType, TaskTypeError

if TYPE_CHECKING:
    from inference.core.registry import ModelSpec

QA_METHODS = ("span", "sentence")
QUESTION_CONTEXT_SCHEMA = "QuestionContext"


def _output(output: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return output or {}


class QuestionAnsweringTask(TaskType):
    """An answer span per question and context; its score is the model's confidence, it has no label."""

    name = "question-answering"
    input_fields = ("question", "context")
    handler = "inference.child.handlers.question_answering:build_qa_handler"
    input_schema = QUESTION_CONTEXT_SCHEMA
    output_schema = "Answer"
    model_keys = ("qa_method", "doc_stride")
    sequences_note = "every sequence its question and context make"
    input_noun = "the question and context"
    split_hint = "split the context"
    export_columns = (
        ExportColumn("question", lambda inputs, output: str(inputs.get("question", ""))),
        ExportColumn("context", lambda inputs, output: str(inputs.get("context", ""))),
        "status",
        ExportColumn("answer", lambda inputs, output: str(_output(output).get("answer", ""))),
        ExportColumn("answer_start", lambda inputs, output: _output(output).get("start"), text=False),
        ExportColumn("answer_end", lambda inputs, output: _output(output).get("end"), text=False),
        "score",
        "low_confidence",
    )
    score_help = "the model's confidence in the answer (higher is surer)"
    input_heading = "Question"
    answer_heading = "Answer [start:end] in its context"
    answer_label = "Answer"

    def schemas(self, max_chars: int) -> dict[str, dict[str, Any]]:
        field = {"type": "string", "minLength": 1, "maxLength": max_chars}
        return {
            QUESTION_CONTEXT_SCHEMA: {
                "type": "object",
                "properties": {name: dict(field) for name in self.input_fields},
                "required": list(self.input_fields),
                "additionalProperties": False,
                "example": task_io.QA_EXAMPLE_INPUT,
            },
            "Answer": {
                "type": "object",
                "properties": {
                    "answer": {"type": "string", "description": "the answer as written in the context"},
                    "start": {"type": "integer", "description": "its first character's offset in the context"},
                    "end": {
                        "type": "integer",
                        "description": "the offset after its last character: context[start:end] == answer",
                    },
                    "score": {"type": "number", "description": "the model's confidence"},
                },
                "required": ["answer", "start", "end", "score"],
                "example": task_io.QA_EXAMPLE_OUTPUT,
            },
        }

    def input_example(self) -> Any:
        return task_io.QA_EXAMPLE_INPUT

    def check_entry(self, entry: Mapping[str, Any]) -> None:
        if entry.get("qa_method", "span") not in QA_METHODS:
            raise TaskTypeError(f"qa_method must be one of {', '.join(QA_METHODS)}")

    def input_tokens(self, spec: ModelSpec, index: int, item: Any) -> int:
        from inference.core.tokens import qa_tokens

        return qa_tokens(spec, index, item["question"], item["context"])
