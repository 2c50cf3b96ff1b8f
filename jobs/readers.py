"""Upload formats: one reader class per format, built once from the upload's fields or a job's stored options.

Ingest (jobs/lifecycle.py) needs two things of a file: check its start in the web request (so the usual
mistakes get their 400 at once) and read all its rows in the offline worker. A reader does both; which
columns, which id column and what limits are the job's, passed in, never the format's. What a reader
learns from the file's start (a detected delimiter, the codec a byte-order mark chose) comes back as a
reader, whose `job_fields` the job stores and `reader_for(job)` builds again. A second format (JSONL:
one JSON object per line, fields by name) is one more class here and a branch in `reader_for` and
`from_upload`; lifecycle does not change.
"""

from __future__ import annotations

import csv
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from jobs.ingest import (
    DecodedLines,
    IngestError,
    IngestLimits,
    Readable,
    Row,
    check_encoding,
    column_field,
    in_task_order,
    numbered_rows,
    read_start,
    strip_nul,
)

if TYPE_CHECKING:
    from jobs.models import Job

DELIMITERS = (",", ";", "\t")
_DELIMITER_NAMES = {",": "comma", ";": "semicolon", "\t": "tab"}
# Python's csv module refuses a field over 128 KiB by raising for the whole file; a cell is bounded
# by the upload limit anyway, and an over-long one must fail only its row ("text too long").
csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))


class Reader(Protocol):
    """What ingest needs of a format. `columns` maps each input field to the name it has in the file
    ({"text": "body"}, or {"question": "q", "context": "passage"}); `id_column` may be empty."""

    def check_start(
        self, binary: Readable, *, columns: Mapping[str, str], id_column: str, limits: IngestLimits
    ) -> Reader:
        """Check the file's start (the first block's bytes and rows); this reader as the file showed it to be."""
        ...

    def rows(
        self, binary: Readable, *, columns: Mapping[str, str], id_column: str, limits: IngestLimits
    ) -> Iterator[Row]:
        """The file's rows, lazily: problems at its start raise at once, later ones while iterating."""
        ...

    def job_fields(self) -> dict[str, str]:
        """The Job fields that keep this reader's options, for `reader_for` to build it again."""
        ...


def pick_delimiter(header_line: str, given: str | None) -> str:
    """The delimiter the user gave, or the candidate that splits the header most (comma by default)."""
    if given:
        given = {"tab": "\t", "\\t": "\t", "comma": ",", "semicolon": ";"}.get(given, given)
        if given not in DELIMITERS:
            raise IngestError("delimiter must be one of: comma, semicolon, tab")
        return given
    counts = {d: header_line.count(d) for d in DELIMITERS}
    best = max(DELIMITERS, key=lambda d: counts[d])
    return best if counts[best] else ","


@dataclass(frozen=True)
class CsvReader:
    """A delimited text file with a header line; columns are found by their header."""

    encoding: str = "utf-8"  # a codec name as check_encoding gives it; a byte-order mark overrides it
    delimiter: str | None = None  # None: detected from the header; also comma, semicolon, tab by name

    def check_start(
        self, binary: Readable, *, columns: Mapping[str, str], id_column: str, limits: IngestLimits
    ) -> CsvReader:
        """Check the header and the first PREFLIGHT_ROWS rows (and the first block's bytes); they are consumed.

        The reader returned has the delimiter chosen and the codec actually used.
        """
        opened, rows = self._open(binary, columns, id_column, limits)
        read_start(rows)
        return opened

    def rows(
        self, binary: Readable, *, columns: Mapping[str, str], id_column: str, limits: IngestLimits
    ) -> Iterator[Row]:
        return self._open(binary, columns, id_column, limits)[1]

    def job_fields(self) -> dict[str, str]:
        # Unresolved (not yet checked against a file), the delimiter is stored empty: detected again.
        return {"encoding": self.encoding, "delimiter": self.delimiter or ""}

    def _open(
        self, binary: Readable, columns: Mapping[str, str], id_column: str, limits: IngestLimits
    ) -> tuple[CsvReader, Iterator[Row]]:
        """Read the header at once; (this reader as the file showed it to be, the data rows lazily)."""
        source = DecodedLines(binary, self.encoding)
        lines = iter(source)
        first = next(lines, None)
        while first is not None and not first.strip():
            first = next(lines, None)
        if first is None:
            raise IngestError("the file is empty")
        chosen = pick_delimiter(first, self.delimiter)
        reader = csv.reader(itertools.chain([first], lines), delimiter=chosen)
        header = [strip_nul(name).strip() for name in next(reader)]
        fields = in_task_order(columns)
        _check_header(header, columns, fields, id_column, chosen)
        positions = {field: header.index(columns[field]) for field in fields}
        id_at = header.index(id_column) if id_column else None

        def cell(record: list[str], at: int | None) -> str:
            return strip_nul(record[at]) if at is not None and at < len(record) else ""

        def records() -> Iterator[tuple[str, dict[str, str]]]:
            for record in reader:
                if record:  # a blank line is skipped; a line holding an empty quoted cell is an empty text
                    yield cell(record, id_at), {field: cell(record, at) for field, at in positions.items()}

        def rows() -> Iterator[Row]:
            count = 0
            try:
                for row in numbered_rows(records(), fields, limits):
                    count += 1
                    yield row
            except csv.Error as exc:
                raise IngestError(f"line {source.line_no}: malformed CSV ({exc})") from None
            if count == 0:
                raise IngestError("the file has a header but no data rows")

        return replace(self, encoding=source.codec, delimiter=chosen), rows()


def _check_header(
    header: list[str], columns: Mapping[str, str], fields: list[str], id_column: str, delimiter: str
) -> None:
    """IngestError naming the upload field to blame when a column read is missing from the header or in it twice."""
    for field, column in columns.items():
        if column not in header:
            raise IngestError(
                f"{field} column {column!r} not found; the {_DELIMITER_NAMES[delimiter]}-separated header has: "
                + ", ".join(repr(h) for h in header),
                field=column_field(field),
            )
    if id_column and id_column not in header:
        raise IngestError(
            f"id column {id_column!r} not found; the header has: " + ", ".join(repr(h) for h in header),
            field="id_column",
        )
    # A column read under a name the header holds twice would be one of them, silently: refused instead.
    read = [(columns[field], column_field(field)) for field in fields] + [(id_column, "id_column")]
    for name, upload_field in read:
        if name and header.count(name) > 1:
            places = ", ".join(str(at + 1) for at, h in enumerate(header) if h == name)
            raise IngestError(
                f"the header has {header.count(name)} columns named {name!r} (columns {places}); "
                "rename them so that each column read has a name of its own",
                field=upload_field,
            )


def from_upload(fields: Mapping[str, object]) -> Reader:
    """The reader an upload's form fields ask for: `encoding` (utf-8 when left out; IngestError for a name
    that is no character encoding) and `delimiter` (comma, semicolon or tab; detected when left out)."""
    encoding = check_encoding(str(fields.get("encoding") or "utf-8"))
    return CsvReader(encoding=encoding, delimiter=str(fields.get("delimiter") or "") or None)


def reader_for(job: Job) -> Reader:
    """The reader of a job's stored upload, from the options its start was checked with."""
    return CsvReader(encoding=job.encoding, delimiter=job.delimiter or None)
