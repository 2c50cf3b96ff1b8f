"""What each task takes and answers: the one home of an input's shape.

The web tier validates and prices inputs by it, the worker's handlers read it, jobs map CSV columns
onto it, and the OpenAPI schema describes it. Importing this module never imports torch.

A task's input is either a plain string (`text` tasks) or an object with named string fields (a
question over a context). A job maps one CSV column onto each field.
"""

from __future__ import annotations

import re

from inference.core.task_types import TaskType, get_task_type

# Each task's input fields, schemas and checks are its descriptor's (inference/core/task_types/); these
# two are the questions most callers ask of it.


def input_fields(task: str) -> tuple[str, ...]:
    """The fields one input of `task` has; ("text",) means a plain string."""
    return get_task_type(task).input_fields


def takes_text(task: str) -> bool:
    """Whether `task`'s inputs are plain strings (else objects with `input_fields(task)`)."""
    return get_task_type(task).takes_text


# A sentence ends at . ! ? (or their full-width forms) followed by space, or at a line break; the
# closing quote or bracket after the mark stays with its sentence.
_SENTENCE_END = re.compile(r"""[.!?]['")\]]*(?=\s)|[。！？]['")\]」』]*|\n\s*""")


def split_sentences(text: str) -> list[tuple[int, int]]:
    """Character spans (start, end) of the sentences in `text`, surrounding whitespace excluded,
    so that text[start:end] is each sentence as written. Empty pieces are dropped."""
    spans: list[tuple[int, int]] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        _add_span(text, start, match.end(), spans)
        start = match.end()
    _add_span(text, start, len(text), spans)
    return spans


def _add_span(text: str, start: int, end: int, spans: list[tuple[int, int]]) -> None:
    piece = text[start:end]
    stripped = piece.strip()
    if stripped:
        first = start + (len(piece) - len(piece.lstrip()))
        spans.append((first, first + len(stripped)))


# Span question-answering windows ------------------------------------------------------------------------
# A question and its context run as windows of max_seq_length tokens, [CLS] question [SEP] part [SEP],
# cut as HF tokenizers do with truncation="only_second", stride and return_overflowing_tokens. The
# arithmetic is here, torch-free, so the web tier prices exactly the windows the worker's handler
# (inference/child/handlers/question_answering.py) will run.

# Fewest context tokens a window must hold beside the question (the handler refuses a longer question).
MIN_CONTEXT_TOKENS_PER_WINDOW = 16


def doc_stride(configured: int | None, max_seq_length: int) -> int:
    """Context tokens consecutive windows share: the models file's doc_stride, else a quarter window."""
    return configured if configured is not None else max_seq_length // 4


def max_question_tokens(max_seq_length: int, pair_specials: int) -> int:
    """The longest question (tokens, without specials) a window holds with enough context beside it."""
    return max_seq_length - pair_specials - MIN_CONTEXT_TOKENS_PER_WINDOW


def window_stride(configured_stride: int, room: int) -> int:
    """The overlap actually used: at most half the context a window holds (the tokenizer panics unless
    stride < room, and an overlap past half a window multiplies the windows)."""
    return min(configured_stride, room // 2)


def span_windows(
    question_tokens: int, context_tokens: int, max_seq_length: int, stride: int, pair_specials: int = 3
) -> list[int]:
    """Each window's length in tokens (no padding) for a question and context of these token counts.

    Each window holds `room` = max_seq_length - question - specials context tokens, and starts
    `room - stride` tokens after the one before (stride from `window_stride`), until one reaches the
    context's end. ValueError when the question leaves fewer than MIN_CONTEXT_TOKENS_PER_WINDOW.
    """
    fixed = question_tokens + pair_specials
    room = max_seq_length - fixed
    if room < MIN_CONTEXT_TOKENS_PER_WINDOW:
        raise ValueError(f"a {question_tokens}-token question leaves {room} tokens of a window for the context")
    if context_tokens <= room:  # it all fits: one window, as long as the pair
        return [fixed + context_tokens]
    step = room - window_stride(stride, room)
    count = 1 + -(-(context_tokens - room) // step)  # ceil: windows until one reaches the context's end
    last = context_tokens - (count - 1) * step
    return [max_seq_length] * (count - 1) + [fixed + last]


def input_chars(item: object) -> int:
    """Characters in one input: a string's length, or the sum of an object's string fields and lists of
    strings (anything else counts 0, so a log line about a malformed input never fails)."""
    if isinstance(item, str):
        return len(item)
    if isinstance(item, dict):
        return sum(input_chars(value) for value in item.values())
    if isinstance(item, list):  # a list of strings (a rerank's documents)
        return sum(len(value) for value in item if isinstance(value, str))
    return 0


# OpenAPI 3.0 schemas of what each task takes and answers are named components, each defined by its task
# type's `schemas()` (inference/web/api/schema.py puts them in the predict endpoint's description). Inputs'
# length limits are settings, so components are built for a `max_chars`.
TEXT_SCHEMA = "Text"
QUESTION_CONTEXT_SCHEMA = "QuestionContext"

# What the models file's `qa` (sentence selection over MiniLM) answers to this question.
QA_EXAMPLE_INPUT = {
    "question": "How long does delivery take?",
    "context": (
        "Refunds are sent to the original card. Delivery takes 5 to 7 working days. "
        "Parcels lost in transit are replaced for free."
    ),
}
QA_EXAMPLE_OUTPUT = {"answer": "Delivery takes 5 to 7 working days.", "start": 39, "end": 74, "score": 0.840174}


def task_schemas(task_types: list[TaskType] | None = None) -> dict[str, tuple[str, str]]:
    """Task -> (its input component, its output component), for the tasks in use."""
    return {t.name: (t.input_schema, t.output_schema) for t in task_types or _in_use()}


def input_schemas(max_chars: int, task_types: list[TaskType] | None = None) -> dict[str, dict]:
    """The input components: a plain string, and each structured task's object."""
    components = {TEXT_SCHEMA: {"type": "string", "maxLength": max_chars, "example": "I was charged twice this month"}}
    for task_type in task_types or _in_use():
        if not task_type.takes_text:
            components[task_type.input_schema] = task_type.schemas(max_chars)[task_type.input_schema]
    return components


def output_schemas(max_chars: int, task_types: list[TaskType] | None = None) -> dict[str, dict]:
    """Every component the tasks define other than their inputs: outputs and their parts (Entity).

    Each output schema requires fields no other one has, so an output matches exactly one (as `oneOf` asks)."""
    found: dict[str, dict] = {}
    types = task_types or _in_use()
    inputs = {t.input_schema for t in types}
    for task_type in types:
        for name, schema in task_type.schemas(max_chars).items():
            if name not in inputs:
                found.setdefault(name, schema)
    return found


def output_components(task_types: list[TaskType] | None = None) -> list[str]:
    """The output components predict may answer, each once (Entity is a part of Entities, not an output)."""
    return list(dict.fromkeys(output for _, output in task_schemas(task_types).values()))


def tasks_with_schema(component: str, task_types: list[TaskType] | None = None) -> list[str]:
    """The tasks that take or answer `component`, for its description."""
    return [task for task, schemas in task_schemas(task_types).items() if component in schemas]


def _in_use() -> list[TaskType]:
    from inference.core.registry import task_types_in_use

    return task_types_in_use()
