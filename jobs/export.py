"""Results out of a job: filtered row querysets and a streamed CSV (memory stays flat for any job size).

The CSV is for spreadsheets, so user-supplied cells that would run as formulas are neutralised; the
JSON results (jobs/api) carry the raw text.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Mapping

from django.db.models import QuerySet
from django.http import StreamingHttpResponse

from jobs.models import Job, JobRow

COLUMNS = [
    "job",
    "index",
    "id",
    "text",
    "status",
    "label",
    "score",
    "corrected_label",
    "low_confidence",
    "reviewed",
    "error",
    "output",
]


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


class _Echo:
    """A file-like object whose write returns the line, so csv.writer can feed a generator."""

    def write(self, value: str) -> str:
        return value


def csv_lines(rows: QuerySet[JobRow], block_rows: int = 1000) -> Iterator[str]:
    """CSV text in blocks of block_rows lines: under ASGI each yielded piece costs a thread hop."""
    writer = csv.writer(_Echo())
    block = [writer.writerow(COLUMNS)]
    for row in rows.iterator(chunk_size=2000):
        block.append(_line(writer, row))
        if len(block) >= block_rows:
            yield "".join(block)
            block = []
    if block:
        yield "".join(block)


def _line(writer, row: JobRow) -> str:
    return writer.writerow(
        [
            row.job_id,
            row.index,
            neutralise(row.external_id),
            neutralise(row.text),
            row.status,
            neutralise(row.label),
            "" if row.score is None else f"{row.score:.6f}",  # a number we formatted, not user text
            neutralise(row.corrected_label),
            "yes" if row.low_confidence else "",
            "yes" if row.reviewed_at else "",
            neutralise(row.error),
            "" if row.output is None else neutralise(json.dumps(row.output, separators=(",", ":"))),
        ]
    )


def csv_response(rows: QuerySet[JobRow], filename: str) -> StreamingHttpResponse:
    response = StreamingHttpResponse(
        csv_lines(rows.order_by("job_id", "index")), content_type="text/csv; charset=utf-8"
    )
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response
