"""What each task takes and answers: the one home of an input's shape.

The web tier validates and prices inputs by it, the worker's handlers read it, jobs map CSV columns
onto it, and the OpenAPI schema describes it. Importing this module never imports torch.

A task's input is either a plain string (`text` tasks) or an object with named string fields (a
question over a context). A job maps one CSV column onto each field.
"""

from __future__ import annotations

import re

# Input fields per task; a task with the single field "text" takes plain strings.
INPUT_FIELDS: dict[str, tuple[str, ...]] = {
    "router": ("text",),
    "embedding": ("text",),
    "text-classification": ("text",),
    "identity": ("text",),
    "token-classification": ("text",),
    "question-answering": ("question", "context"),
}


def input_fields(task: str) -> tuple[str, ...]:
    """The fields one input of `task` has; ("text",) means a plain string."""
    return INPUT_FIELDS[task]


def takes_text(task: str) -> bool:
    """Whether `task`'s inputs are plain strings (else objects with `input_fields(task)`)."""
    return INPUT_FIELDS[task] == ("text",)


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
    """Characters in one input: a string's length, or the sum of an object's string fields (anything
    else counts 0, so a log line about a malformed input never fails)."""
    if isinstance(item, str):
        return len(item)
    if isinstance(item, dict):
        return sum(len(value) for value in item.values() if isinstance(value, str))
    return 0


# OpenAPI 3.0 schemas of what each task takes and answers, as named components (inference/web/api/schema.py
# puts them in the predict endpoint's description). Inputs' length limits are settings, so inputs are
# built by `input_schemas(max_chars)`; outputs are fixed.
TEXT_SCHEMA = "Text"
QUESTION_CONTEXT_SCHEMA = "QuestionContext"

# Task -> (its input component, its output component).
TASK_SCHEMAS: dict[str, tuple[str, str]] = {
    "router": (TEXT_SCHEMA, "Classification"),
    "text-classification": (TEXT_SCHEMA, "Classification"),
    "embedding": (TEXT_SCHEMA, "Embedding"),
    "identity": (TEXT_SCHEMA, "Identity"),
    "token-classification": (TEXT_SCHEMA, "Entities"),
    "question-answering": (QUESTION_CONTEXT_SCHEMA, "Answer"),
}

# What the models file's `qa` (sentence selection over MiniLM) answers to this question.
QA_EXAMPLE_INPUT = {
    "question": "How long does delivery take?",
    "context": (
        "Refunds are sent to the original card. Delivery takes 5 to 7 working days. "
        "Parcels lost in transit are replaced for free."
    ),
}
QA_EXAMPLE_OUTPUT = {"answer": "Delivery takes 5 to 7 working days.", "start": 39, "end": 74, "score": 0.840174}

# Each output schema requires fields no other one has, so an output matches exactly one (as `oneOf` asks).
OUTPUT_SCHEMAS: dict[str, dict] = {
    "Classification": {
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
    },
    "Embedding": {
        "type": "object",
        "properties": {
            "embedding": {"type": "array", "items": {"type": "number"}, "description": "L2-normalised vector"},
            "dim": {"type": "integer", "description": "its length"},
        },
        "required": ["embedding", "dim"],
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
        "example": QA_EXAMPLE_OUTPUT,
    },
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
    "Identity": {
        "type": "object",
        "properties": {
            "chars": {"type": "integer", "description": "the text's length in characters"},
            "tokens": {"type": "integer", "description": "its tokens, as admission priced them"},
        },
        "required": ["chars", "tokens"],
    },
}


def input_schemas(max_chars: int) -> dict[str, dict]:
    """The input components: a plain string, and the question-answering object (fields from INPUT_FIELDS)."""
    field = {"type": "string", "minLength": 1, "maxLength": max_chars}
    qa_fields = INPUT_FIELDS["question-answering"]
    return {
        TEXT_SCHEMA: {"type": "string", "maxLength": max_chars, "example": "I was charged twice this month"},
        QUESTION_CONTEXT_SCHEMA: {
            "type": "object",
            "properties": {name: dict(field) for name in qa_fields},
            "required": list(qa_fields),
            "additionalProperties": False,
            "example": QA_EXAMPLE_INPUT,
        },
    }


def output_components() -> list[str]:
    """The output components predict may answer, each once (Entity is a part of Entities, not an output)."""
    return list(dict.fromkeys(output for _, output in TASK_SCHEMAS.values()))


def tasks_with_schema(component: str) -> list[str]:
    """The tasks that take or answer `component`, for its description."""
    return [task for task, schemas in TASK_SCHEMAS.items() if component in schemas]
