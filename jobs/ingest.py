"""Reading an uploaded CSV into job rows, streaming: memory stays flat whatever the file's size.

Bytes are decoded line by line, so an undecodable byte is reported with its line and column. Errors
that make the file unusable raise IngestError (the caller deletes the half-made job); an empty or
oversized text cell fails only its row.
"""

from __future__ import annotations

import codecs
import csv
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from django.db import transaction
from django.utils import timezone

from jobs.models import Chunk, Job, JobRow, JobStatus, RowStatus

DELIMITERS = (",", ";", "\t")
_DELIMITER_NAMES = {",": "comma", ";": "semicolon", "\t": "tab"}


class IngestError(Exception):
    """The file cannot be used; the message says why, in terms the uploader can act on."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


@dataclass(frozen=True)
class IngestLimits:
    max_rows: int
    max_text_chars: int
    batch_rows: int
    chunk_rows: int


def row_error(text: str, max_text_chars: int) -> str:
    """Why a text cannot run ("" when it can); checked at ingest and again when a retried row runs."""
    if not text.strip():
        return "empty text"
    if len(text) > max_text_chars:
        return f"text too long: {len(text)} characters, the limit is {max_text_chars}"
    return ""


def check_encoding(name: str) -> str:
    """The codec name to read with; UTF-8 is read as utf-8-sig so a BOM is accepted."""
    try:
        canonical = codecs.lookup(name).name
    except LookupError:
        raise IngestError(f"unknown encoding {name!r}; use a Python codec name such as utf-8 or gbk") from None
    return "utf-8-sig" if canonical in ("utf-8", "utf-8-sig") else canonical


class _Lines:
    """Decoded lines of a binary file, counting physical lines for error messages."""

    def __init__(self, binary: IO[bytes], encoding: str) -> None:
        self.binary, self.encoding = binary, encoding
        self.decoder = codecs.getincrementaldecoder(encoding)(errors="strict")
        self.line_no = 0

    def __iter__(self) -> Iterator[str]:
        for raw in self.binary:
            self.line_no += 1
            try:
                yield self.decoder.decode(raw)
            except UnicodeDecodeError as exc:
                bad = raw[exc.start : exc.start + 1].hex()
                shown = self.encoding.replace("utf-8-sig", "utf-8")
                raise IngestError(
                    f"line {self.line_no}: byte 0x{bad} at column {exc.start + 1} is not valid {shown} ({exc.reason}); "
                    "if the file uses another encoding, say so with the `encoding` field (for example gbk or latin-1)"
                ) from None
        tail = self.decoder.decode(b"", final=True)
        if tail:
            yield tail


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


def read_rows(
    binary: IO[bytes], *, encoding: str, text_column: str, id_column: str, delimiter: str | None, limits: IngestLimits
) -> tuple[str, Iterator[tuple[int, str, str, str]]]:
    """(delimiter, iterator of (index, external id, text, row error)). Header problems raise at once."""
    lines = iter(_Lines(binary, encoding))
    first = next(lines, None)
    while first is not None and not first.strip():
        first = next(lines, None)
    if first is None:
        raise IngestError("the file is empty")
    chosen = pick_delimiter(first, delimiter)

    def all_lines() -> Iterator[str]:
        yield first
        yield from lines

    reader = csv.reader(all_lines(), delimiter=chosen)
    header = [name.strip() for name in next(reader)]
    if text_column not in header:
        raise IngestError(
            f"text column {text_column!r} not found; the {_DELIMITER_NAMES[chosen]}-separated header has: "
            + ", ".join(repr(h) for h in header)
        )
    if id_column and id_column not in header:
        raise IngestError(f"id column {id_column!r} not found; the header has: " + ", ".join(repr(h) for h in header))
    text_at = header.index(text_column)
    id_at = header.index(id_column) if id_column else None

    def rows() -> Iterator[tuple[int, str, str, str]]:
        index = 0
        try:
            for record in reader:
                if not record:
                    continue  # a blank line; a line holding an empty quoted cell is an empty text
                if index >= limits.max_rows:
                    raise IngestError(f"the file has more than {limits.max_rows} data rows, the limit per job")
                text = record[text_at] if text_at < len(record) else ""
                external_id = record[id_at] if id_at is not None and id_at < len(record) else ""
                error = row_error(text, limits.max_text_chars)
                # One character past the limit is kept, so a retried row fails the same check again.
                yield index, external_id[:255], text[: limits.max_text_chars + 1], error
                index += 1
        except csv.Error as exc:
            raise IngestError(f"line {reader.line_num}: malformed CSV ({exc})") from None
        if index == 0:
            raise IngestError("the file has a header but no data rows")

    return chosen, rows()


def ingest(job: Job, binary: IO[bytes], *, delimiter: str | None, limits: IngestLimits) -> list[Chunk]:
    """Fill `job` with rows and chunks from `binary`, in committed bulk batches; returns the chunks.

    On IngestError the caller deletes the job (its rows go with it), so nothing half-made remains.
    """
    chosen, rows = read_rows(
        binary,
        encoding=job.encoding,
        text_column=job.text_column,
        id_column=job.id_column,
        delimiter=delimiter,
        limits=limits,
    )
    batch: list[JobRow] = []
    total = 0
    for index, external_id, text, error in rows:
        status = RowStatus.FAILED if error else RowStatus.PENDING
        batch.append(JobRow(job=job, index=index, external_id=external_id, text=text, status=status, error=error))
        if len(batch) >= limits.batch_rows:
            JobRow.objects.bulk_create(batch)
            total += len(batch)
            batch = []
    if batch:
        JobRow.objects.bulk_create(batch)
        total += len(batch)
    chunks = [
        Chunk(job=job, first_index=start, end_index=min(start + limits.chunk_rows, total), enqueued_at=timezone.now())
        for start in range(0, total, limits.chunk_rows)
    ]
    with transaction.atomic():
        Chunk.objects.bulk_create(chunks)
        job.total_rows = total
        job.delimiter = chosen
        job.status = JobStatus.QUEUED
        job.save(update_fields=["total_rows", "delimiter", "status"])
        job.refresh_counts()
    return list(job.chunks.all())
