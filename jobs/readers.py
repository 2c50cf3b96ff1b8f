"""Upload formats: one reader class per format, built once from the upload's fields or a job's stored options.

Ingest (jobs/lifecycle.py) needs two things of a file: check its start in the web request (so the usual
mistakes get their 400 at once) and read all its rows in the offline worker. A reader does both; which
columns, which id column and what limits are the job's, passed in, never the format's. What a reader
learns from the file's start (a detected delimiter, the codec a byte-order mark chose) comes back as a
reader, whose `job_fields` the job stores and `reader_for(job)` builds again. Formats: CSV, JSON lines
(one JSON object per line, fields by key) and OpenAI batch request lines (a batch's input file); each is
one class here and a branch in `reader_for` and `from_upload`; lifecycle does not change.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
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
    json_line_chars,
    numbered_rows,
    read_start,
    shown,
    shown_list,
    storable,
    strip_nul,
)
from jobs.models import FileFormat

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

    def validate(self, binary: Readable, *, limits: IngestLimits) -> int | None:
        """A pass over the whole file before any row is written, for formats whose problems must all be
        known first (a batch fails validation as a whole); the number of rows, or None (no such pass)."""
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


class _StreamedFormat:
    """A format read in one pass: `_open` gives the reader as the file showed it to be, and its rows lazily;
    its problems are found while the rows are read (no validation pass of its own)."""

    def check_start(
        self, binary: Readable, *, columns: Mapping[str, str], id_column: str, limits: IngestLimits
    ) -> Reader:
        """Check the file's start (the first PREFLIGHT_ROWS rows and the first block's bytes; they are
        consumed); the reader returned has what the start showed (a detected delimiter, the codec used)."""
        opened, rows = self._open(binary, columns, id_column, limits)
        read_start(rows)
        return opened

    def rows(
        self, binary: Readable, *, columns: Mapping[str, str], id_column: str, limits: IngestLimits
    ) -> Iterator[Row]:
        return self._open(binary, columns, id_column, limits)[1]

    def validate(self, binary: Readable, *, limits: IngestLimits) -> None:
        return None

    def _open(
        self, binary: Readable, columns: Mapping[str, str], id_column: str, limits: IngestLimits
    ) -> tuple[Reader, Iterator[Row]]:
        raise NotImplementedError


@dataclass(frozen=True)
class CsvReader(_StreamedFormat):
    """A delimited text file with a header line; columns are found by their header."""

    encoding: str = "utf-8"  # a codec name as check_encoding gives it; a byte-order mark overrides it
    delimiter: str | None = None  # None: detected from the header; also comma, semicolon, tab by name

    def job_fields(self) -> dict[str, str]:
        # Unresolved (not yet checked against a file), the delimiter is stored empty: detected again.
        return {"file_format": FileFormat.CSV, "encoding": self.encoding, "delimiter": self.delimiter or ""}

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
        quotes = _QuoteTracker(chosen)
        reader = csv.reader(quotes.follow(itertools.chain([first], lines), source), delimiter=chosen)
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


class _QuoteTracker:
    """Follows the csv module's quoting over the lines it reads, to catch a quoted value never closed.

    Python's csv reader (not strict) reads such a value to the end of the file, or to the next quote,
    so a stray quote turned the rest of a file, or the rows up to the next quoted value, into one row's
    text, silently. Both are refused: a value still open at the end of the file, and one that ran over
    line ends and is closed by a quote with text right after it (a value's closing quote is followed
    by a delimiter or the line's end; here the "closing" quote was another value's opening one). A
    one-line value with text after its closing quote is left to the csv module (it joins the two), as
    before: it harms no other row. The rules followed are the module's for the default dialect: a
    quote opens a quoted value only as its first character (elsewhere it is a character of the value),
    and inside one a doubled quote stands for a quote.
    """

    def __init__(self, delimiter: str) -> None:
        self.delimiter = delimiter
        self.open_at: int | None = None  # the line whose quote is still open

    def follow(self, lines: Iterator[str], source: DecodedLines) -> Iterator[str]:
        """`lines`, as they are; IngestError at the end of the file if a quoted value is still open."""
        for line in lines:
            self._scan(line, source.line_no)
            yield line
        if self.open_at is not None:
            raise IngestError(
                f"line {self.open_at}: a quoted value opened on this line is never closed, so everything after it, "
                f"to the end of the file (line {source.line_no}), would be one value; close the quote, or write a "
                'quote inside a value as two ("")'
            )

    def _scan(self, line: str, line_no: int) -> None:
        i, end = 0, len(line)
        while i < end:
            at = line.find('"', i)
            if at < 0:
                return
            if self.open_at is not None:
                if line.startswith('"', at + 1):  # a doubled quote: a quote in the value
                    i = at + 2
                    continue
                after = line[at + 1 : at + 2]
                if self.open_at != line_no and after not in ("", "\n", "\r", self.delimiter):
                    raise IngestError(
                        f"line {self.open_at}: a quoted value opened on this line runs on to line {line_no}, where "
                        "text follows the quote that ends it, so the rows between would be one value; close the "
                        'quote on its own line, or write a quote inside a value as two ("")'
                    )
                self.open_at = None  # closed; what follows up to the delimiter is the value's too
            elif at == 0 or line[at - 1] == self.delimiter:
                self.open_at = line_no
            i = at + 1


def _check_header(
    header: list[str], columns: Mapping[str, str], fields: list[str], id_column: str, delimiter: str
) -> None:
    """IngestError naming the upload field to blame when a column read is missing from the header or in it twice."""
    # The header is quoted in these messages, but never whole: a line of a million commas is a million cells.
    for field, column in columns.items():
        if column not in header:
            raise IngestError(
                f"{field} column {shown(column)} not found; the {_DELIMITER_NAMES[delimiter]}-separated header has: "
                + shown_list(header),
                field=column_field(field),
            )
    if id_column and id_column not in header:
        raise IngestError(
            f"id column {shown(id_column)} not found; the header has: " + shown_list(header),
            field="id_column",
        )
    # A column read under a name the header holds twice would be one of them, silently: refused instead.
    read = [(columns[field], column_field(field)) for field in fields] + [(id_column, "id_column")]
    for name, upload_field in read:
        if name and header.count(name) > 1:
            places = [at + 1 for at, h in enumerate(header) if h == name]
            raise IngestError(
                f"the header has {len(places)} columns named {shown(name)} (columns {shown_list(places)}); "
                "rename them so that each column read has a name of its own",
                field=upload_field,
            )


@dataclass(frozen=True)
class JsonlReader(_StreamedFormat):
    """JSON lines: one JSON object per line, input fields and the id read by key (`columns` name the keys).

    A value that is a number is read as its text; one that is missing, null or not a string or number
    fails its row ("empty text"), as an empty CSV cell does. A line that is not a JSON object makes the
    file unusable (named by its line), as malformed CSV does.
    """

    encoding: str = "utf-8"

    def job_fields(self) -> dict[str, str]:
        return {"file_format": FileFormat.JSONL, "encoding": self.encoding, "delimiter": ""}

    def _open(
        self, binary: Readable, columns: Mapping[str, str], id_column: str, limits: IngestLimits
    ) -> tuple[JsonlReader, Iterator[Row]]:
        source = DecodedLines(binary, self.encoding, json_line_chars(limits.max_text_chars))
        fields = in_task_order(columns)

        def records() -> Iterator[tuple[str, dict[str, str]]]:
            for line in source:
                if not line.strip():
                    continue
                record = _json_object(line, source.line_no)
                values = {field: _value(record.get(columns[field])) for field in fields}
                yield (_value(record.get(id_column)) if id_column else ""), values

        def rows() -> Iterator[Row]:
            count = 0
            for row in numbered_rows(records(), fields, limits):
                count += 1
                yield row
            if count == 0:
                raise IngestError("the file has no JSON lines")

        return replace(self, encoding=source.codec), rows()


def _json_object(line: str, line_no: int) -> dict:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise IngestError(f"line {line_no}: not valid JSON ({exc})") from None
    except RecursionError:
        raise IngestError(f"line {line_no}: not valid JSON (nested too deep)") from None
    if not isinstance(record, dict):
        raise IngestError(f"line {line_no}: each line must be a JSON object, got {type(record).__name__}")
    return record


def _value(value: object) -> str:
    """A JSON value as a cell's text: strings as they are, numbers written out, anything else empty."""
    if isinstance(value, str):
        return storable(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return ""


# Validation errors listed on a failed batch (the count of the rest is in its message).
MAX_LISTED_ERRORS = 100


@dataclass(frozen=True)
class BatchRequestReader:
    """OpenAI Batch API request lines: `{"custom_id", "method": "POST", "url", "body"}`, one request each.

    `endpoint` is the batch's (every line's `url` must be it) and `model` the one model a batch runs:
    `/v1/embeddings` lines name it in `body.model`, predict lines in the endpoint. A line whose envelope
    is wrong (not JSON, no or a repeated `custom_id`, another method, url or model) makes the batch fail
    validation: every such line is listed (up to MAX_LISTED_ERRORS) with its number, as OpenAI does.
    A body the endpoint itself would refuse (an empty input, a wrong type) fails only its line, with the
    endpoint's own message: it lands in the error file, answered as the synchronous call would be.

    A line holds one input (`input` a string, or `inputs` a list of one): a batch line is a job row.
    """

    endpoint: str
    model: str

    def check_start(
        self, binary: Readable, *, columns: Mapping[str, str], id_column: str, limits: IngestLimits
    ) -> BatchRequestReader:
        return self  # validated by the worker: a batch answers `validating` at once, as OpenAI's does

    def job_fields(self) -> dict[str, str]:
        return {"file_format": FileFormat.BATCH, "encoding": "utf-8", "delimiter": ""}

    def validate(self, binary: Readable, *, limits: IngestLimits) -> int:
        """Check every line's envelope (not its body: that is the endpoint's, per line) before any row is
        written; the number of requests. IngestError listing the bad lines (the batch fails validation)."""
        errors: list[dict] = []
        failed_lines = count = 0
        # custom_id's 64-bit digest -> its line: a million ids of 255 characters would hold ~300 MB as strings,
        # ~90 MB so (a false duplicate between two ids needs a 64-bit collision: about 1 in 10^7 for a million).
        seen: dict[int, int] = {}
        spec = self._spec()
        source = DecodedLines(binary, "utf-8", json_line_chars(limits.max_text_chars))
        lines = iter(source)
        while True:
            try:
                line = next(lines, None)
            except IngestError as error:  # a line too long to hold, or bytes that are not UTF-8
                errors.append(_problem(source.line_no + 1, "invalid_line", error.message))
                failed_lines += 1
                break
            if line is None:
                break
            if not line.strip():
                continue
            problem, _ = self._envelope(line, source.line_no, spec, seen)
            if problem is not None:
                failed_lines += 1
                if len(errors) < MAX_LISTED_ERRORS:
                    errors.append(problem)
                continue
            count += 1
            if count > limits.max_rows:
                raise IngestError(f"the file has more than {limits.max_rows} requests, the limit per batch")
        if errors:
            more = f" (the first {len(errors)} listed)" if failed_lines > len(errors) else ""
            raise IngestError(
                f"{failed_lines} of the file's lines are not valid requests for {self.endpoint}{more}; "
                f"line {errors[0]['line']}: {errors[0]['message']}",
                details=errors,
            )
        if count == 0:
            raise IngestError("the file has no request lines", details=[_problem(0, "empty_file", "the file is empty")])
        return count

    def rows(
        self, binary: Readable, *, columns: Mapping[str, str], id_column: str, limits: IngestLimits
    ) -> Iterator[Row]:
        """The requests as rows, once `validate` has passed (a line found bad here still fails the batch)."""
        spec = self._spec()
        source = DecodedLines(binary, "utf-8", json_line_chars(limits.max_text_chars))
        index = 0
        for line in source:
            if not line.strip():
                continue
            problem, request = self._envelope(line, source.line_no, spec, None)
            if problem is not None:
                raise IngestError(f"line {problem['line']}: {problem['message']}", details=[problem])
            if index >= limits.max_rows:
                raise IngestError(f"the file has more than {limits.max_rows} requests, the limit per batch")
            yield _request_row(index, request["custom_id"], request["body"], spec, self.endpoint, limits)
            index += 1

    def _spec(self):
        from inference.core.registry import get_registry  # the registry of the process reading the file

        return get_registry().get(self.model)

    def _envelope(self, line: str, line_no: int, spec, seen: dict[int, int] | None):
        """(a validation error, None) or (None, the request); `seen` (custom_ids so far) checks duplicates."""
        try:
            request = json.loads(line)
        except ValueError as exc:
            return _problem(line_no, "invalid_json_line", f"not valid JSON ({exc})"), None
        except RecursionError:
            return _problem(line_no, "invalid_json_line", "not valid JSON (nested too deep)"), None
        if not isinstance(request, dict):
            return _problem(line_no, "invalid_request", "each line must be a JSON object"), None
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            return _problem(line_no, "missing_custom_id", "`custom_id` must be a non-empty string", "custom_id"), None
        if len(custom_id) > 255 or storable(custom_id) != custom_id:
            return _problem(
                line_no,
                "invalid_custom_id",
                "`custom_id` must be at most 255 characters of text (no NUL, no lone surrogate)",
                "custom_id",
            ), None
        if seen is not None:
            digest = int.from_bytes(hashlib.blake2b(custom_id.encode(errors="replace"), digest_size=8).digest())
            if digest in seen:
                return _problem(
                    line_no,
                    "duplicate_custom_id",
                    f"custom_id {custom_id[:80]!r} is also on line {seen[digest]}; each request needs its own",
                    "custom_id",
                ), None
            seen[digest] = line_no
        if request.get("method") != "POST":
            return _problem(line_no, "invalid_method", "`method` must be POST", "method"), None
        if request.get("url") != self.endpoint:
            got = str(request.get("url"))[:120]
            return _problem(
                line_no, "invalid_url", f"`url` is {got!r}; every line of this batch must be {self.endpoint}", "url"
            ), None
        body = request.get("body")
        if not isinstance(body, dict):
            return _problem(line_no, "invalid_body", "`body` must be a JSON object", "body"), None
        if self.endpoint == EMBEDDINGS_ENDPOINT:
            model = body.get("model")
            if spec is None or spec.task != EMBEDDING_TASK:
                return _problem(
                    line_no,
                    "model_not_found",
                    f"the model {str(model)[:80]!r} is not an embedding model served here",
                    "body.model",
                ), None
            if model != self.model:
                return _problem(
                    line_no,
                    "model_mismatch",
                    f"`body.model` is {str(model)[:80]!r}; a batch runs one model, {self.model!r} (from its first line)",
                    "body.model",
                ), None
        return None, request


def _problem(line: int, code: str, message: str, param: str | None = None) -> dict:
    # Messages quote the line's values, which may hold what the database cannot (NUL, lone surrogates).
    return {"line": line, "code": code, "message": storable(message), "param": param}


EMBEDDINGS_ENDPOINT = "/v1/embeddings"
EMBEDDING_TASK = "embedding"


def _request_row(index: int, custom_id: str, body: dict, spec, endpoint: str, limits: IngestLimits) -> Row:
    """The row of one request: its input, or the endpoint's own refusal as the row's error."""
    from inference.core.registry import get_registry
    from inference.core.task_io import input_fields, takes_text
    from inference.web.api.openai_compat import parse_embeddings_request  # the endpoint's own checks
    from inference.web.validation import validate_inputs
    from platform_.errors import ApiError

    try:
        if endpoint == EMBEDDINGS_ENDPOINT:
            if isinstance(body.get("input"), list) and len(body["input"]) > 1:
                raise ApiError(
                    400, "invalid_value", "a batch line holds one input: send each text as a line of its own"
                )
            checked = parse_embeddings_request(body, get_registry(), max_inputs=1, max_chars=limits.max_text_chars)
            options = {"encoding_format": checked.encoding_format} if checked.encoding_format != "float" else None
            return Row(index, custom_id, storable(checked.texts[0]), "", options)
        inputs = validate_inputs(body, max_inputs=1, max_chars=limits.max_text_chars, task=spec.task, model=spec.name)
        # NUL characters are dropped and lone surrogates replaced (the database cannot hold them), as in
        # CSV and JSON lines cells.
        if takes_text(spec.task):
            return Row(index, custom_id, storable(inputs[0]), "")
        # Stored as a file's cells would be (the task type writes a list of documents as JSON text).
        cells = spec.task_type.cells_from_input(inputs[0])
        values = {field: storable(cells[field]) for field in input_fields(spec.task)}
        return Row(index, custom_id, values[input_fields(spec.task)[0]], "", values)
    except ApiError as error:
        text = body.get("input") if endpoint == EMBEDDINGS_ENDPOINT else body.get("inputs")
        shown = text if isinstance(text, str) else json.dumps(text)[:1000] if text is not None else ""
        return Row(index, custom_id, storable(shown)[: limits.max_text_chars + 1], storable(error.detail[:500]))


def from_upload(fields: Mapping[str, object]) -> Reader:
    """The reader an upload's form fields ask for: `file_format` (csv or jsonl), `encoding` (utf-8 when left
    out; IngestError for a name that is no character encoding) and, for CSV, `delimiter` (comma, semicolon
    or tab; detected when left out)."""
    encoding = check_encoding(str(fields.get("encoding") or "utf-8"))
    if fields.get("file_format") == FileFormat.JSONL:
        return JsonlReader(encoding=encoding)
    return CsvReader(encoding=encoding, delimiter=str(fields.get("delimiter") or "") or None)


def reader_for(job: Job) -> Reader:
    """The reader of a job's stored upload, from the options its start was checked with."""
    if job.file_format == FileFormat.JSONL:
        return JsonlReader(encoding=job.encoding)
    if job.file_format == FileFormat.BATCH:
        return BatchRequestReader(endpoint=job.batch.endpoint, model=job.model)
    return CsvReader(encoding=job.encoding, delimiter=job.delimiter or None)
