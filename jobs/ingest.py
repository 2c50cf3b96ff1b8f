"""What every upload format shares on its way into job rows: errors, limits, decoding, row checks.

A format's reader (jobs/readers.py: CSV today) parses the file; this module holds what does not depend
on the format. The web request checks the file's start (codec, byte-order mark, header and the first
rows, so the usual mistakes get their 400 at once), and an offline worker reads the whole stored upload
(jobs/lifecycle.py `run_ingest`), streaming: memory stays flat whatever the file's size. Bytes are
decoded in blocks and split into lines after decoding, so UTF-16 and UTF-32 files split correctly, and
an undecodable byte is reported with its line and column. Errors that make the file unusable raise
IngestError; an empty or oversized value fails only its row.

Which columns are read follows the model's task type (inference/core/task_types/): one column per input
field, named by the upload's `<field>_column` (`text_column` for text tasks; `question_column` and
`context_column` for question-answering; a plugin task's own fields likewise). `input_columns` turns those
upload fields into the mapping, and the task type checks a row's cells.
"""

from __future__ import annotations

import codecs
import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from inference.core.registry import task_types_in_use
from inference.core.task_types import BUILTIN, TaskType, cell_error, get_task_type

# Decoding happens a block at a time; checking the file's start therefore checks at least the first block's bytes.
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


# Error messages quote what the uploader sent (header cells, column names, values) so they can find it;
# this much of it, so that an error answer stays a few KB whatever the input (a header of a million
# empty cells was answered with its whole header, twice: 160 MB for a 20 MB upload).
SHOWN_CHARS = 64
SHOWN_ITEMS = 10


def shown(value: object, max_chars: int = SHOWN_CHARS) -> str:
    """`value` quoted for an error message (a number as it is), cut to max_chars and its full length given."""
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if len(text) <= max_chars:
        return repr(text)
    return f"{text[:max_chars]!r}... ({len(text)} characters)"


def shown_list(values: list, max_items: int = SHOWN_ITEMS, max_chars: int = SHOWN_CHARS) -> str:
    """The first max_items of `values`, each `shown`, then how many more there are."""
    listed = ", ".join(shown(value, max_chars) for value in values[:max_items])
    more = len(values) - max_items
    return f"{listed} and {more} more" if more > 0 else listed


class IngestError(Exception):
    """The file cannot be used; the message says why, in terms the uploader can act on.

    `field` is the upload field to blame (the API's error key, the form field marked): `file` unless
    a column field was wrong.
    """

    def __init__(self, message: str, status: int = 400, field: str = "file", details: list[dict] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.field = message, status, field
        # The file's problems line by line ({"line", "code", "message", "param"}), when a reader lists them.
        self.details = details or []


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


# Every `<field>_column` an upload for a built-in task may carry, in a stable order: text_column, question_column, ...
COLUMN_FIELDS: tuple[str, ...] = tuple(
    dict.fromkeys(column_field(field) for task in BUILTIN for field in get_task_type(task).input_fields)
)


def column_fields() -> tuple[str, ...]:
    """COLUMN_FIELDS and those of the plugin tasks the models file names (a rerank's query_column, ...)."""
    fields = (column_field(field) for task_type in task_types_in_use() for field in task_type.input_fields)
    return tuple(dict.fromkeys([*COLUMN_FIELDS, *fields]))


def default_column(upload_field: str) -> str:
    """The column an empty `<field>_column` means: the input field's own name ("question_column" ->
    "question", "text_column" -> "text"). One rule for the API and the upload page's placeholders."""
    return upload_field.removesuffix("_column")


def input_columns(model: str, task: str, given: Mapping[str, str]) -> dict[str, str]:
    """Input field -> CSV column for `model`'s task, from the upload's `<field>_column` values.

    A column field left out means the column named like the field (default_column). A column field the
    task does not read is refused rather than ignored: a client naming `text_column` for a
    question-answering model believes a column is read that is not.
    """
    fields = get_task_type(task).input_fields
    wanted = [column_field(field) for field in fields]
    every = column_fields()
    chosen = {name: (given.get(name) or "").strip() for name in every}
    for name in wanted:
        chosen[name] = chosen[name] or default_column(name)
    extra = [name for name in every if chosen[name] and name not in wanted]
    if extra:
        raise IngestError(
            f"model {shown(model)} (task {task}) reads {' and '.join(wanted)}, not {', '.join(extra)}; leave it out",
            field=extra[0],
        )
    return {field: chosen[column_field(field)] for field in fields}


def in_task_order(fields: Iterable[str]) -> list[str]:
    """Input field names in their task's order (question before context), whatever order they come in.

    JSON read back from PostgreSQL (jsonb) has its keys sorted by length, so a stored mapping cannot
    be trusted to say which field comes first; the task's definition can.
    """
    given = list(fields)
    task_type = task_for_fields(given)
    return list(task_type.input_fields) if task_type else sorted(given)


def task_for_fields(fields: Iterable[str]) -> TaskType | None:
    """The task type whose inputs have exactly these fields (tasks with the same fields read the same
    columns and check cells alike); None when no task in use has them."""
    wanted = set(fields)
    return next((t for t in task_types_in_use() if set(t.input_fields) == wanted), None)


def field_error(field: str, value: object, max_chars: int) -> str:
    """Why one input field's value cannot run ("" when it can); the message names the field."""
    return cell_error(field, value, max_chars)


def row_error(text: str, max_text_chars: int) -> str:
    """Why a text cannot run ("" when it can); checked at ingest and again when a retried row runs."""
    return field_error("text", text, max_text_chars)


def inputs_error(inputs: object, fields: tuple[str, ...], max_chars: int) -> str:
    """Why a structured input cannot run ("" when it can): the first field that is empty or too long."""
    if not isinstance(inputs, dict):
        return f"no {' and '.join(fields)} stored for this row"
    task_type = task_for_fields(fields)
    if task_type is not None:
        return task_type.cells_error(inputs, max_chars)
    return next((e for field in fields if (e := field_error(field, inputs.get(field), max_chars))), "")


def check_encoding(name: str) -> str:
    """The canonical name of a character encoding; IngestError for unknown codecs and non-text ones.

    Python's codec registry also holds transforms (rot13, base64, hex, zlib, bz2: the last two
    decompress, so a small upload could expand without bound); `_is_text_encoding` marks them.
    """
    try:
        info = codecs.lookup(name)
    except (LookupError, ValueError, TypeError):
        raise IngestError(
            f"unknown encoding {shown(name)}; use a character encoding such as {VALID_ENCODINGS}"
        ) from None
    if getattr(info, "_is_text_encoding", True) is False or info.name in _NOT_CHARSETS:
        raise IngestError(
            f"encoding {shown(name)} is not a character encoding of text files; use one such as {VALID_ENCODINGS}"
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


class DecodedLines:
    """Decoded lines of a binary file (each ending in "\\n" but the last), counting lines for error messages."""

    def __init__(self, binary: Readable, encoding: str, max_line_chars: int | None = None) -> None:
        self.binary = binary
        # JSON formats: a line is parsed whole, at ~26x its size in memory for a line of empty objects, so
        # one longer than any legal line is refused before it is held (CSV lines may be split by quotes).
        self.max_line_chars = max_line_chars
        self.first = binary.read(BLOCK_BYTES)
        self.codec, skip = codec_for(self.first, encoding)
        self.first = self.first[skip:]
        self.decoder = codecs.getincrementaldecoder(self.codec)(errors="strict")
        self.line_no = 0

    def __iter__(self) -> Iterator[str]:
        partial: list[str] = []  # the current line so far (a list: a huge line must not be copied per block)
        partial_chars = 0
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
                last = pieces.pop()  # after the last "\n": the start of the next line ("" at a line's end)
                partial = [last] if last else []
                partial_chars = len(partial[0]) if partial else 0
                for line in pieces:
                    self._check_length(self.line_no + 1, len(line))
                    self.line_no += 1
                    yield line + "\n"
            elif text:
                partial.append(text)
                partial_chars += len(text)
            self._check_length(self.line_no + 1, partial_chars)
            if final:
                break
            block = self.binary.read(BLOCK_BYTES)
        if partial:
            self.line_no += 1
            yield "".join(partial)

    def _check_length(self, line_no: int, chars: int) -> None:
        if self.max_line_chars is not None and chars > self.max_line_chars:
            raise IngestError(
                f"line {line_no} is longer than {self.max_line_chars} characters, more than any valid line "
                "holds (JOBS_MAX_TEXT_CHARS per value)"
            )

    def _error(self, exc: UnicodeDecodeError, partial: str) -> IngestError:
        before = partial + exc.object[: exc.start].decode(self.codec, errors="replace")
        line = self.line_no + 1 + before.count("\n")
        column = len(before) - before.rfind("\n")
        bad = exc.object[exc.start : exc.start + 1].hex()
        return IngestError(
            f"line {line}: byte 0x{bad} at column {column} is not valid {self.codec} ({exc.reason}); "
            "if the file uses another encoding, say so with the `encoding` field (for example gbk or latin-1)"
        )


class Row(NamedTuple):
    """One data row: `text` is what is shown and searched (a text task's input; a question's text);
    `inputs` the structured input of other tasks (None for text tasks); `error` fails the row alone."""

    index: int
    external_id: str
    text: str
    error: str
    inputs: dict[str, str] | None = None


def storable(value: str) -> str:
    """`value` as the database can keep it: without NUL characters, and lone surrogates (which JSON's
    "\\ud800" escapes can make, and UTF-8 cannot encode) replaced by "?"."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", "replace").decode("utf-8")
    return strip_nul(value)


def json_line_chars(max_text_chars: int) -> int:
    """The longest JSON line a reader holds: a few values at the limit (escaped, up to 6 characters each
    for a "\\uXXXX"), plus room for the rest of the object."""
    return 6 * 2 * max_text_chars + 64 * 1024


def strip_nul(value: str) -> str:
    """`value` without NUL characters: PostgreSQL text cannot hold them (they appear when a UTF-16 file
    is read as UTF-8)."""
    return value.replace("\x00", "") if "\x00" in value else value


def numbered_rows(
    records: Iterable[tuple[str, dict[str, str]]], fields: list[str], limits: IngestLimits
) -> Iterator[Row]:
    """Rows from a file's records in file order, each an (external id, input field -> value) pair.

    `fields` are the input fields in their task's order: a single "text" field makes plain text rows,
    others structured ones, whose readable text is their task's first field (the question). A file
    past `limits.max_rows` raises; an empty or too long value fails its row alone.
    """
    structured = fields != ["text"]
    keep_chars = limits.max_text_chars + 1  # one past the limit: a retried row fails the same check again
    task_type = task_for_fields(fields) if structured else None
    index = 0
    for external_id, values in records:
        if index >= limits.max_rows:
            raise IngestError(f"the file has more than {limits.max_rows} data rows, the limit per job")
        if task_type is not None:  # the task's own check of its cells (a JSON list of documents, ...)
            error = task_type.cells_error(values, limits.max_text_chars)
        else:
            error = next((e for f in fields if (e := field_error(f, values[f], limits.max_text_chars))), "")
        values = {field: values[field][:keep_chars] for field in fields}
        if structured:
            # The first field (a question) is the row's readable text in lists, search and admin.
            yield Row(index, external_id[:255], values[fields[0]], error, values)
        else:
            yield Row(index, external_id[:255], values["text"], error)
        index += 1


def read_start(rows: Iterator[Row]) -> None:
    """Read the first PREFLIGHT_ROWS rows (what the web request checks before answering); they are consumed."""
    for _ in itertools.islice(rows, PREFLIGHT_ROWS):
        pass
