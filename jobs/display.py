"""What the admin and the job pages both show, in one home: durations and a job's standing in words, and
rows' inputs and answers as HTML.

A text task's answer is its label; a question-answering answer is a span of the context (shown with
its offsets, and marked in the context); token-classification entities are spans of the text (listed,
and marked in it). Every piece of a client's text or a model's answer is escaped by format_html.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from inference.core.registry import get_registry
from inference.core.task_types import TaskType, TaskTypeError, get_task_type
from jobs.ingest import in_task_order
from jobs.models import Job, JobRow, JobStatus

if TYPE_CHECKING:
    from jobs.scheduler import Standing

ANSWER_SHOWN_CHARS = 80  # an answer's cut in a row list
SNIPPET_CONTEXT_CHARS = 80  # characters of context shown either side of an answer on the job page
SNIPPET_TEXT_CHARS = 300  # a text's cut on the job page, entities marked within it

Span = tuple[Any, Any, str]  # start, end, title (offsets come from stored JSON: checked before use)
# A job's time left while no offline rows were written for a minute (no worker yet, or all were idle).
NO_RATE_YET = "not known yet"


def duration_text(seconds: float | None) -> str:
    """A duration as a person reads it: "42 s", "3 min 05 s", "2 h 07 min"; "–" when unknown."""
    if seconds is None:
        return "–"
    total = max(int(round(seconds)), 0)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


def count_text(count: int, unit: str) -> str:
    """ "1 chunk", "1,536 rows"."""
    return f"{count:,} {unit}{'' if count == 1 else 's'}"


def time_left_text(job: Job, standing: Standing | None) -> str:
    """A job's time left from where it stands in the offline backlog (the measured offline rate and the
    job's share of it, jobs/scheduler.py), not from its own rate alone: a job behind others has to wait."""
    if job.is_terminal:
        return "ended"
    if job.status == JobStatus.INGESTING:
        return "reading the file"
    if standing is None:  # created, its file not yet picked up
        return "waiting for a worker"
    return NO_RATE_YET if standing.eta_s is None else duration_text(standing.eta_s)


def ahead_texts(standing: Standing) -> tuple[str, str]:
    """Other jobs' chunks handed out before this job's next one, and their rows run before it ends."""
    if standing.chunks_ahead is None or standing.rows_ahead is None:  # past the forecast's horizon
        return "too many to count", "too many to count"
    return count_text(standing.chunks_ahead, "chunk"), count_text(standing.rows_ahead, "row")


@dataclass(frozen=True)
class ScoreMeaning:
    """What a row's score is for its model's task: the column's heading and a sentence for its tooltip."""

    heading: str
    help: str


_NO_SCORE_MEANING = ScoreMeaning("Score", "the model's score for the row")


@dataclass(frozen=True)
class Headings:
    """The job page's row table headings for a task: its input column's and its answer column's."""

    input: str = "Text"
    answer: str = "Label"
    answer_label: str = "Label"  # the answer cell's name where the table stacks on a narrow screen


def task_of(model: str) -> str:
    """The task of a served model, or "" for a model the models file no longer lists."""
    spec = get_registry().get(model)
    return spec.task if spec else ""


def _task_type(task: str) -> TaskType | None:
    try:
        return get_task_type(task) if task else None
    except TaskTypeError:  # a task the models file no longer names
        return None


def score_meaning(task: str) -> ScoreMeaning:
    """What a row's score means for the task (its task type's `score_heading` and `score_help`)."""
    task_type = _task_type(task)
    return ScoreMeaning(task_type.score_heading, task_type.score_help) if task_type else _NO_SCORE_MEANING


def headings(task: str) -> Headings:
    """The row table's headings for the task (its task type's `input_heading` and `answer_heading`)."""
    task_type = _task_type(task)
    if task_type is None:
        return Headings()
    return Headings(
        task_type.input_heading, task_type.answer_heading, task_type.answer_label or task_type.answer_heading
    )


def _output(row: JobRow) -> dict[str, Any]:
    return row.output if isinstance(row.output, dict) else {}


def _entities(row: JobRow) -> list[dict[str, Any]] | None:
    entities = _output(row).get("entities")
    return [e for e in entities if isinstance(e, dict)] if isinstance(entities, list) else None


def answer_html(row: JobRow) -> SafeString | str:
    """A question-answering or token-classification row's answer in a line; "" for other outputs."""
    output = _output(row)
    if "answer" in output:
        answer = str(output["answer"])
        shown = answer if len(answer) <= ANSWER_SHOWN_CHARS else answer[: ANSWER_SHOWN_CHARS - 1] + "…"
        return format_html(
            '{} <span class="row-muted">[{}:{}]</span>', shown or "(no answer)", output.get("start"), output.get("end")
        )
    entities = _entities(row)
    if entities is None:
        return ""
    if not entities:
        return format_html('<span class="row-muted">{}</span>', "no entities")
    return format_html_join(
        " · ", '<span class="row-muted">{}</span> {}', ((e.get("label"), e.get("text")) for e in entities)
    )


def marked(text: str, spans: list[Span]) -> SafeString:
    """`text` with each (start, end, title) span in a <mark>; spans that overlap, are empty or fall outside are skipped."""
    pieces: list[SafeString] = []
    at = 0
    valid = [s for s in spans if isinstance(s[0], int) and isinstance(s[1], int)]
    for start, end, title in sorted(valid, key=lambda s: (s[0], s[1])):
        if start < at or end > len(text) or start >= end:
            continue
        pieces.append(format_html('{}<mark title="{}">{}</mark>', text[at:start], title, text[start:end]))
        at = end
    pieces.append(format_html("{}", text[at:]))
    return format_html_join("", "{}", ((piece,) for piece in pieces))


def _answer_span(output: dict[str, Any]) -> Span:
    return output.get("start"), output.get("end"), f"answer, score {output.get('score')}"


def _entity_spans(entities: list[dict[str, Any]]) -> list[Span]:
    return [(e.get("start"), e.get("end"), f"{e.get('label')} {e.get('score')}") for e in entities]


def input_html(row: JobRow) -> SafeString:
    """The row's whole input as the model saw it: the text, or each field of a structured input; the
    answer marked in the context (question-answering), or the entities in the text."""
    output = _output(row)
    if isinstance(row.inputs, dict):
        spans = {"context": [_answer_span(output)]} if "answer" in output else {}
        return format_html_join(
            "",
            '<p><b>{}</b></p><div class="row-input">{}</div>',
            ((field, marked(str(row.inputs[field]), spans.get(field, []))) for field in in_task_order(row.inputs)),
        )
    entities = _entities(row)
    return format_html('<div class="row-input">{}</div>', marked(row.text, _entity_spans(entities or [])))


def snippet_html(row: JobRow) -> SafeString | str:
    """A short view of the answer in its input, for a table row: the answer marked with some context
    either side, or the text's start with its entities marked; "" for other tasks."""
    output = _output(row)
    context = row.inputs.get("context") if isinstance(row.inputs, dict) else None
    if "answer" in output and isinstance(context, str):
        start, end = output.get("start"), output.get("end")
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= len(context)):
            return ""
        first = max(start - SNIPPET_CONTEXT_CHARS, 0)
        last = min(end + SNIPPET_CONTEXT_CHARS, len(context))
        return format_html(
            "{}{}{}",
            "…" if first else "",
            marked(context[first:last], [(start - first, end - first, _answer_span(output)[2])]),
            "…" if last < len(context) else "",
        )
    entities = _entities(row)
    if entities is None:
        return ""
    shown = row.text[:SNIPPET_TEXT_CHARS]
    return format_html(
        "{}{}", marked(shown, _entity_spans(entities)), "…" if len(row.text) > SNIPPET_TEXT_CHARS else ""
    )
