"""Results out of a job: filtered row querysets and streamed downloads, one Writer class per format (CSV for
spreadsheets, JSON lines for programs); memory stays flat for any job size.

The CSV is for spreadsheets, so user-supplied cells that would run as formulas are neutralised; the
JSON results (jobs/api) carry the raw text. Its columns follow the model's task type's `export_columns`
(inference/core/task_types/): a text task's label and score; a question-answering row's question,
context, answer and offsets; a token-classification row's entities; a plugin task's own. Every layout ends with the full `output` JSON, and an export mixing jobs of tasks with
different layouts uses the text one (the `output` column still carries each row's answer).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from django.db.models import Exists, OuterRef, QuerySet
from django.http import StreamingHttpResponse

from inference.core.registry import get_registry
from inference.core.task_types import TEXT_EXPORT, ExportColumn, TaskType, get_task_type
from jobs.models import Job, JobRow
from platform_.streams import streaming_response


def filtered_rows(job: Job, params: Mapping[str, str]) -> QuerySet[JobRow]:
    rows = job.rows.order_by("index")
    if params.get("status"):
        rows = rows.filter(status=params["status"])
    if params.get("label"):
        rows = rows.filter(label=params["label"])
    if params.get("low_confidence") in ("1", "true", "yes"):
        rows = rows.filter(low_confidence=True)
    return rows


# A spreadsheet reads a cell starting with one of these as a formula (OWASP, CSV injection): a row
# text of `=cmd|' /C calc'!A0` would run on the reviewer's machine. Tab and carriage return too,
# since some spreadsheets strip them and then see the formula.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def neutralise(cell: str) -> str:
    """A cell that a spreadsheet would run as a formula, prefixed with a single quote (shown as text)."""
    return "'" + cell if cell.startswith(_FORMULA_STARTS) else cell


# A column: its header and how a row fills it. Cells from the client's file or the model's answer go
# through `neutralise`; numbers we format ourselves do not need to.
Column = tuple[str, Callable[[JobRow], str]]


def _output(row: JobRow) -> dict[str, Any]:
    return row.output if isinstance(row.output, dict) else {}


def _number(value: object, digits: int = 6) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return ""
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


_JOB: tuple[Column, ...] = (
    ("job", lambda row: str(row.job_id)),
    # `row` counts from 1 as the pages and the API do; `index` (from 0) stays for the clients that read it.
    ("row", lambda row: str(row.row_number)),
    ("index", lambda row: str(row.index)),
    ("id", lambda row: neutralise(row.external_id)),
)
_TAIL: tuple[Column, ...] = (
    # The model version that answered the row (issue 21): a job's rows share one unless staff moved it.
    ("model_version", lambda row: row.model_version),
    ("reviewed", lambda row: "yes" if row.reviewed_at else ""),
    ("error", lambda row: neutralise(row.error)),
    ("output", lambda row: "" if row.output is None else neutralise(json.dumps(row.output, separators=(",", ":")))),
)
# The row's own columns a task type's layout names by string.
_NAMED: dict[str, Column] = {
    "text": ("text", lambda row: neutralise(row.text)),
    "status": ("status", lambda row: row.status),
    "label": ("label", lambda row: neutralise(row.label)),
    "score": ("score", lambda row: "" if row.score is None else f"{row.score:.6f}"),
    "corrected_label": ("corrected_label", lambda row: neutralise(row.corrected_label)),
    "low_confidence": ("low_confidence", lambda row: "yes" if row.low_confidence else ""),
}


def _task_column(column: ExportColumn) -> Column:
    """A task type's column: its value from the row's input cells and output, neutralised when it is text."""

    def cell(row: JobRow) -> str:
        inputs = row.inputs if isinstance(row.inputs, dict) else {}
        output = None if row.output is None else _output(row)
        value = column.value(inputs, output)
        return neutralise("" if value is None else str(value)) if column.text else _number(value)

    return column.header, cell


def columns_of(layout: tuple[str | ExportColumn, ...]) -> tuple[Column, ...]:
    """The export's columns for a task type's layout: the job's, the task's, then the tail every layout ends with."""
    named = tuple(_NAMED[c] if isinstance(c, str) else _task_column(c) for c in layout)
    return (*_JOB, *named, *_TAIL)


TEXT_COLUMNS = columns_of(TEXT_EXPORT)
# Task name -> its columns, for the tasks whose layout is not the text one (built once per task type).
LAYOUTS: dict[str, tuple[Column, ...]] = {}


def layout_of(task_type: TaskType) -> tuple[Column, ...]:
    if task_type.export_columns == TEXT_EXPORT:
        return TEXT_COLUMNS
    if task_type.name not in LAYOUTS:
        LAYOUTS[task_type.name] = columns_of(task_type.export_columns)
    return LAYOUTS[task_type.name]


QA_COLUMNS = layout_of(get_task_type("question-answering"))
ENTITY_COLUMNS = layout_of(get_task_type("token-classification"))


def layout_for_models(models: set[str]) -> tuple[Column, ...]:
    """The columns for rows of jobs on these models: their task's layout when they share one, else the text one."""
    registry = get_registry()
    layouts = {layout_of(spec.task_type) if (spec := registry.get(name)) else TEXT_COLUMNS for name in models}
    return layouts.pop() if len(layouts) == 1 else TEXT_COLUMNS


class _Echo:
    """A file-like object whose write returns the line, so csv.writer can feed a generator."""

    def write(self, value: str) -> str:
        return value


def models_of(rows: QuerySet[JobRow]) -> set[str]:
    """The models of the jobs these rows belong to: one index probe per job, not a scan of the rows."""
    jobs = Job.objects.filter(Exists(rows.order_by().filter(job_id=OuterRef("pk"))))
    return set(jobs.values_list("model", flat=True))


class Writer(Protocol):
    """A results format: what a download of rows is called and how its text is made, a block at a time."""

    content_type: str
    extension: str

    def lines(self, rows: QuerySet[JobRow], block_rows: int = 1000) -> Iterator[str]: ...


class CsvWriter:
    """For spreadsheets: columns by the rows' task type (`export_columns`), formula-like cells neutralised."""

    content_type = "text/csv; charset=utf-8"
    extension = "csv"

    def lines(self, rows: QuerySet[JobRow], block_rows: int = 1000) -> Iterator[str]:
        return csv_lines(rows, block_rows, layout_for_models(models_of(rows)))


class JsonlWriter:
    """For programs: one JSON object per row, the raw values as the JSON results API gives them (the row's
    `inputs` and the model's `output` as objects, nothing neutralised), plus its job."""

    content_type = "application/jsonl; charset=utf-8"
    extension = "jsonl"
    FIELDS = (
        "job_id", "index", "external_id", "text", "inputs", "status", "label", "score", "output", "error",
        "attempts", "low_confidence", "corrected_label", "model_version",
    )  # fmt: skip

    def lines(self, rows: QuerySet[JobRow], block_rows: int = 1000) -> Iterator[str]:
        block: list[str] = []
        for values in rows.values(*self.FIELDS).iterator(chunk_size=2000):
            values = {"job": values.pop("job_id"), "row": values["index"] + 1, **values}  # row: as pages number it
            block.append(json.dumps(values, ensure_ascii=False, separators=(",", ":")) + "\n")
            if len(block) >= block_rows:
                yield "".join(block)
                block = []
        if block:
            yield "".join(block)


WRITERS: dict[str, Writer] = {"csv": CsvWriter(), "jsonl": JsonlWriter()}


def csv_lines(
    rows: QuerySet[JobRow], block_rows: int = 1000, columns: tuple[Column, ...] = TEXT_COLUMNS
) -> Iterator[str]:
    """CSV text in blocks of block_rows lines: under ASGI each yielded piece costs a thread hop."""
    writer = csv.writer(_Echo())
    block = [writer.writerow([name for name, _ in columns])]
    for row in rows.iterator(chunk_size=2000):
        block.append(writer.writerow([cell(row) for _, cell in columns]))
        if len(block) >= block_rows:
            yield "".join(block)
            block = []
    if block:
        yield "".join(block)


def response(request, rows: QuerySet[JobRow], stem: str, writer: Writer) -> StreamingHttpResponse:
    """The rows as a streamed download `<stem>.<extension>` in the writer's format, in job and row order."""
    streamed = streaming_response(request, writer.lines(rows.order_by("job_id", "index")), writer.content_type)
    streamed["Content-Disposition"] = f'attachment; filename="{stem}.{writer.extension}"'
    return streamed


def csv_response(request, rows: QuerySet[JobRow], filename: str) -> StreamingHttpResponse:
    return response(request, rows, filename.removesuffix(".csv"), WRITERS["csv"])
