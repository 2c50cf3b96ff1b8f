"""Results out of a job: filtered row querysets and streamed downloads, one Writer class per format (CSV for
spreadsheets, JSON lines for programs); memory stays flat for any job size.

The CSV is for spreadsheets, so user-supplied cells that would run as formulas are neutralised; the
JSON results (jobs/api) carry the raw text. Its columns follow the model's task: a text task's label
and score; a question-answering row's question, context, answer and offsets; a token-classification
row's entities. Every layout ends with the full `output` JSON, and an export mixing jobs of tasks with
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


def _input(row: JobRow, field: str) -> str:
    return str(row.inputs.get(field, "")) if isinstance(row.inputs, dict) else ""


def _number(value: object, digits: int = 6) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return ""
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def _entities_text(row: JobRow) -> str:
    """Entities as a person reads them: "PER: Ada Lovelace; LOC: London"."""
    entities = _output(row).get("entities") or []
    return "; ".join(f"{e.get('label', '')}: {e.get('text', '')}" for e in entities if isinstance(e, dict))


_JOB: tuple[Column, ...] = (
    ("job", lambda row: str(row.job_id)),
    # `row` counts from 1 as the pages and the API do; `index` (from 0) stays for the clients that read it.
    ("row", lambda row: str(row.row_number)),
    ("index", lambda row: str(row.index)),
    ("id", lambda row: neutralise(row.external_id)),
)
_TAIL: tuple[Column, ...] = (
    ("reviewed", lambda row: "yes" if row.reviewed_at else ""),
    ("error", lambda row: neutralise(row.error)),
    ("output", lambda row: "" if row.output is None else neutralise(json.dumps(row.output, separators=(",", ":")))),
)
_LOW: Column = ("low_confidence", lambda row: "yes" if row.low_confidence else "")
_SCORE: Column = ("score", lambda row: "" if row.score is None else f"{row.score:.6f}")

TEXT_COLUMNS: tuple[Column, ...] = (
    *_JOB,
    ("text", lambda row: neutralise(row.text)),
    ("status", lambda row: row.status),
    ("label", lambda row: neutralise(row.label)),
    _SCORE,
    ("corrected_label", lambda row: neutralise(row.corrected_label)),
    _LOW,
    *_TAIL,
)
QA_COLUMNS: tuple[Column, ...] = (
    *_JOB,
    ("question", lambda row: neutralise(_input(row, "question"))),
    ("context", lambda row: neutralise(_input(row, "context"))),
    ("status", lambda row: row.status),
    ("answer", lambda row: neutralise(str(_output(row).get("answer", "")))),
    ("answer_start", lambda row: _number(_output(row).get("start"))),
    ("answer_end", lambda row: _number(_output(row).get("end"))),
    _SCORE,
    _LOW,
    *_TAIL,
)
ENTITY_COLUMNS: tuple[Column, ...] = (
    *_JOB,
    ("text", lambda row: neutralise(row.text)),
    ("status", lambda row: row.status),
    ("entities", lambda row: neutralise(_entities_text(row))),
    ("entity_count", lambda row: str(len(_output(row).get("entities") or [])) if row.output is not None else ""),
    ("truncated", lambda row: "yes" if _output(row).get("truncated") else ""),
    *_TAIL,
)
LAYOUTS: dict[str, tuple[Column, ...]] = {"question-answering": QA_COLUMNS, "token-classification": ENTITY_COLUMNS}


def layout_for_models(models: set[str]) -> tuple[Column, ...]:
    """The columns for rows of jobs on these models: their task's layout when they share one, else the text one."""
    registry = get_registry()
    tasks = {spec.task if (spec := registry.get(name)) else "" for name in models}
    named = {task if task in LAYOUTS else "text" for task in tasks}
    return LAYOUTS[named.pop()] if len(named) == 1 and named != {"text"} else TEXT_COLUMNS


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
    """For spreadsheets: columns by the rows' task (LAYOUTS), formula-like cells neutralised."""

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
        "attempts", "low_confidence", "corrected_label",
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
