"""Reading an uploaded CSV into job rows, streaming: memory stays flat whatever the file's size.

Two callers: the web request runs `preflight` on the upload (codec, byte-order mark, header and the
first rows, so the usual mistakes get their 400 at once), and an offline worker reads the whole
stored upload with `read_rows` (jobs/lifecycle.py `run_ingest`). Bytes are decoded in blocks and split
into lines after decoding, so UTF-16 and UTF-32 files split correctly, and an undecodable byte is
reported with its line and column. Errors that make the file unusable raise IngestError; an empty or
oversized cell fails only its row.

Which columns are read follows the model's task (inference/task_io.py): one CSV column per input
field, named by the upload's `<field>_column` (`text_column` for text tasks; `question_column` and
`context_column` for question-answering). `input_columns` turns those upload fields into the mapping.
"""

from __future__ import annotations

import codecs
import csv
import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, NamedTuple, Protocol

from inference.task_io import INPUT_FIELDS, input_fields, takes_text

DELIMITERS = (",", ";", "\t")
_DELIMITER_NAMES = {",": "comma", ";": "semicolon", "\t": "tab"}
# Decoding happens a block at a time; the preflight therefore checks at least the first block's bytes.
BLOCK_BYTES = 64 * 1024
# Data rows the web request reads before answering; the rest is read by the ingest task.
PREFLIGHT_ROWS = 100
VALID_ENCODINGS = "utf-8, utf-16, utf-32, latin-1, cp1252, gbk, shift_jis"
# Codecs Python calls text encodings that are not character sets a file is written in: `undefined`
# always fails, idna and punycode encode host names, the escape codecs rewrite backslashes.
_NOT_CHARSETS = {"undefined", "idna", "punycode", "unicode-escape", "raw-unicode-escape"}
# utf-32 first: its little-endian mark starts with utf-16's.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
# Python's csv module refuses a field over 128 KiB by raising for the whole file; a cell is bounded
# by the upload limit anyway, and an over-long one must fail only its row ("text too long").
csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))


class IngestError(Exception):
    """The file cannot be used; the message says why, in terms the uploader can act on.

    `field` is the upload field to blame (the API's error key, the form field marked): `file` unless
    a column field was wrong.
    """

    def __init__(self, message: str, status: int = 400, field: str = "file") -> None:
        super().__init__(message)
        self.message, self.status, self.field = message, status, field


@dataclass(frozen=True)
class IngestLimits:
    max_rows: int
    max_text_chars: int
    batch_rows: int
    chunk_rows: int


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


def column_field(field: str) -> str:
    """The upload field naming the CSV column of an input field: "question" -> "question_column"."""
    return f"{field}_column"


# Every `<field>_column` an upload may carry, in a stable order: text_column, question_column, ...
COLUMN_FIELDS: tuple[str, ...] = tuple(
    dict.fromkeys(column_field(field) for fields in INPUT_FIELDS.values() for field in fields)
)


def input_columns(model: str, task: str, given: Mapping[str, str]) -> dict[str, str]:
    """Input field -> CSV column for `model`'s task, from the upload's `<field>_column` values.

    `text_column` may be left out (it means "text"), the other fields may not. A column field the task
    does not read is refused rather than ignored: a client naming `text_column` for a question-answering
    model believes a column is read that is not.
    """
    fields = input_fields(task)
    wanted = [column_field(field) for field in fields]
    chosen = {name: (given.get(name) or "").strip() for name in COLUMN_FIELDS}
    if takes_text(task) and not chosen["text_column"]:
        chosen["text_column"] = "text"
    missing = [name for name in wanted if not chosen[name]]
    if missing:
        raise IngestError(
            f"model {model!r} (task {task}) needs {' and '.join(wanted)}; missing: {', '.join(missing)}",
            field=missing[0],
        )
    extra = [name for name in COLUMN_FIELDS if chosen[name] and name not in wanted]
    if extra:
        raise IngestError(
            f"model {model!r} (task {task}) reads {' and '.join(wanted)}, not {', '.join(extra)}; leave it out",
            field=extra[0],
        )
    return {field: chosen[column_field(field)] for field in fields}


def in_task_order(fields: Iterable[str]) -> list[str]:
    """Input field names in their task's order (question before context), whatever order they come in.

    JSON read back from PostgreSQL (jsonb) has its keys sorted by length, so a stored mapping cannot
    be trusted to say which field comes first; the task's definition can.
    """
    given = list(fields)
    for task_fields in INPUT_FIELDS.values():
        if set(task_fields) == set(given):
            return list(task_fields)
    return sorted(given)


def field_error(field: str, value: object, max_chars: int) -> str:
    """Why one input field's value cannot run ("" when it can); the message names the field."""
    if not isinstance(value, str) or not value.strip():
        return f"empty {field}"
    if len(value) > max_chars:
        return f"{field} too long: {len(value)} characters, the limit is {max_chars}"
    return ""


def row_error(text: str, max_text_chars: int) -> str:
    """Why a text cannot run ("" when it can); checked at ingest and again when a retried row runs."""
    return field_error("text", text, max_text_chars)


def inputs_error(inputs: object, fields: tuple[str, ...], max_chars: int) -> str:
    """Why a structured input cannot run ("" when it can): the first field that is empty or too long."""
    if not isinstance(inputs, dict):
        return f"no {' and '.join(fields)} stored for this row"
    for field in fields:
        error = field_error(field, inputs.get(field), max_chars)
        if error:
            return error
    return ""


def check_encoding(name: str) -> str:
    """The canonical name of a character encoding; IngestError for unknown codecs and non-text ones.

    Python's codec registry also holds transforms (rot13, base64, hex, zlib, bz2: the last two
    decompress, so a small upload could expand without bound); `_is_text_encoding` marks them.
    """
    try:
        info = codecs.lookup(name)
    except (LookupError, ValueError, TypeError):
        raise IngestError(f"unknown encoding {name!r}; use a character encoding such as {VALID_ENCODINGS}") from None
    if getattr(info, "_is_text_encoding", True) is False or info.name in _NOT_CHARSETS:
        raise IngestError(
            f"encoding {name!r} is not a character encoding of text files; use one such as {VALID_ENCODINGS}"
        )
    return "utf-8" if info.name == "utf-8-sig" else info.name


def codec_for(head: bytes, encoding: str) -> tuple[str, int]:
    """(codec to decode with, bytes of byte-order mark to skip) for a file starting with `head`.

    A byte-order mark wins over the encoding given (an uploader rarely knows, and the mark does not
    lie). Without one, utf-16 and utf-32 cannot know the byte order: a clear error, not a guess.
    """
    for bom, codec in _BOMS:
        if head.startswith(bom):
            return codec, len(bom)
    if encoding in ("utf-16", "utf-32"):
        raise IngestError(
            f"encoding {encoding!r} needs a byte-order mark (BOM) at the start of the file and this file has none; "
            f"say {encoding}-le or {encoding}-be"
        )
    return encoding, 0


class _Lines:
    """Decoded lines of a binary file (each ending in "\\n" but the last), counting lines for error messages."""

    def __init__(self, binary: Readable, encoding: str) -> None:
        self.binary = binary
        self.first = binary.read(BLOCK_BYTES)
        self.codec, skip = codec_for(self.first, encoding)
        self.first = self.first[skip:]
        self.decoder = codecs.getincrementaldecoder(self.codec)(errors="strict")
        self.line_no = 0

    def __iter__(self) -> Iterator[str]:
        partial: list[str] = []  # the current line so far (a list: a huge line must not be copied per block)
        block = self.first
        while True:
            final = not block
            try:
                text = self.decoder.decode(block, final=final)
            except UnicodeDecodeError as exc:
                raise self._error(exc, "".join(partial)) from None
            except UnicodeError as exc:  # a codec's own complaint without a position
                raise IngestError(f"the file does not decode as {self.codec}: {exc}") from None
            if "\n" in text:
                pieces = text.split("\n")
                pieces[0] = "".join(partial) + pieces[0]
                partial = [pieces.pop()] if pieces[-1] else []
                for line in pieces:
                    self.line_no += 1
                    yield line + "\n"
            elif text:
                partial.append(text)
            if final:
                break
            block = self.binary.read(BLOCK_BYTES)
        if partial:
            self.line_no += 1
            yield "".join(partial)

    def _error(self, exc: UnicodeDecodeError, partial: str) -> IngestError:
        before = partial + exc.object[: exc.start].decode(self.codec, errors="replace")
        line = self.line_no + 1 + before.count("\n")
        column = len(before) - before.rfind("\n")
        bad = exc.object[exc.start : exc.start + 1].hex()
        return IngestError(
            f"line {line}: byte 0x{bad} at column {column} is not valid {self.codec} ({exc.reason}); "
            "if the file uses another encoding, say so with the `encoding` field (for example gbk or latin-1)"
        )


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


class Row(NamedTuple):
    """One data row: `text` is what is shown and searched (a text task's input; a question's text);
    `inputs` the structured input of other tasks (None for text tasks); `error` fails the row alone."""

    index: int
    external_id: str
    text: str
    error: str
    inputs: dict[str, str] | None = None


class CsvRows(NamedTuple):
    delimiter: str
    encoding: str  # the codec actually used (a byte-order mark may have chosen it)
    rows: Iterator[Row]


def _clean(cell: str) -> str:
    # PostgreSQL text cannot hold NUL; they appear when a UTF-16 file is read as UTF-8.
    return cell.replace("\x00", "") if "\x00" in cell else cell


def read_rows(
    binary: Readable,
    *,
    encoding: str,
    columns: Mapping[str, str],
    id_column: str,
    delimiter: str | None,
    limits: IngestLimits,
) -> CsvRows:
    """The file's rows, lazily; header problems raise at once, later ones while iterating.

    `columns` maps each input field to its CSV column ({"text": "body"}, or {"question": "q",
    "context": "passage"}): a single "text" field makes plain text rows, others structured ones, whose
    readable text is their task's first field (the question).
    """
    source = _Lines(binary, encoding)
    lines = iter(source)
    first = next(lines, None)
    while first is not None and not first.strip():
        first = next(lines, None)
    if first is None:
        raise IngestError("the file is empty")
    chosen = pick_delimiter(first, delimiter)
    reader = csv.reader(itertools.chain([first], lines), delimiter=chosen)
    header = [_clean(name).strip() for name in next(reader)]
    for field, column in columns.items():
        if column not in header:
            raise IngestError(
                f"{field} column {column!r} not found; the {_DELIMITER_NAMES[chosen]}-separated header has: "
                + ", ".join(repr(h) for h in header),
                field=column_field(field),
            )
    if id_column and id_column not in header:
        raise IngestError(
            f"id column {id_column!r} not found; the header has: " + ", ".join(repr(h) for h in header),
            field="id_column",
        )
    # A column read under a name the header holds twice would be one of them, silently: refused instead.
    read = [(columns[field], column_field(field)) for field in in_task_order(columns)] + [(id_column, "id_column")]
    for name, upload_field in read:
        if name and header.count(name) > 1:
            places = ", ".join(str(at + 1) for at, h in enumerate(header) if h == name)
            raise IngestError(
                f"the header has {header.count(name)} columns named {name!r} (columns {places}); "
                "rename them so that each column read has a name of its own",
                field=upload_field,
            )
    positions = {field: header.index(columns[field]) for field in in_task_order(columns)}
    structured = list(positions) != ["text"]
    id_at = header.index(id_column) if id_column else None

    def cell(record: list[str], at: int | None) -> str:
        return _clean(record[at]) if at is not None and at < len(record) else ""

    def rows() -> Iterator[Row]:
        index = 0
        keep_chars = limits.max_text_chars + 1  # one past the limit: a retried row fails the same check again
        try:
            for record in reader:
                if not record:
                    continue  # a blank line; a line holding an empty quoted cell is an empty text
                if index >= limits.max_rows:
                    raise IngestError(f"the file has more than {limits.max_rows} data rows, the limit per job")
                external_id = cell(record, id_at)[:255]
                values = {field: cell(record, at) for field, at in positions.items()}
                error = next(
                    (e for field, value in values.items() if (e := field_error(field, value, limits.max_text_chars))),
                    "",
                )
                values = {field: value[:keep_chars] for field, value in values.items()}
                if structured:
                    # The first field (a question) is the row's readable text in lists, search and admin.
                    yield Row(index, external_id, next(iter(values.values())), error, values)
                else:
                    yield Row(index, external_id, values["text"], error)
                index += 1
        except csv.Error as exc:
            raise IngestError(f"line {source.line_no}: malformed CSV ({exc})") from None
        if index == 0:
            raise IngestError("the file has a header but no data rows")

    return CsvRows(chosen, source.codec, rows())


def preflight(
    binary: IO[bytes],
    *,
    encoding: str,
    columns: Mapping[str, str],
    id_column: str,
    delimiter: str | None,
    limits: IngestLimits,
) -> CsvRows:
    """Check the header and the first PREFLIGHT_ROWS rows (and the first block's bytes); the rows are consumed."""
    parsed = read_rows(
        binary,
        encoding=check_encoding(encoding),
        columns=columns,
        id_column=id_column,
        delimiter=delimiter,
        limits=limits,
    )
    for _ in itertools.islice(parsed.rows, PREFLIGHT_ROWS):
        pass
    return parsed
