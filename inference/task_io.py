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
