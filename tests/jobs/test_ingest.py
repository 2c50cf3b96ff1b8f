"""CSV reading: delimiters, encodings, quoting, and errors that name the line and the problem."""

from __future__ import annotations

import codecs
import io

import pytest

from jobs.export import neutralise
from jobs.ingest import (
    BLOCK_BYTES,
    PREFLIGHT_ROWS,
    IngestError,
    IngestLimits,
    check_encoding,
)
from jobs.readers import CsvReader, pick_delimiter

LIMITS = IngestLimits(max_rows=5, max_text_chars=50, batch_rows=2, chunk_rows=2)


def rows_of(data: bytes, text_column="text", id_column="", encoding="utf-8", delimiter=None):
    reader = CsvReader(encoding=encoding, delimiter=delimiter)
    wanted = {"columns": {"text": text_column}, "id_column": id_column, "limits": LIMITS}
    rows = list(reader.rows(io.BytesIO(data), **wanted))
    chosen = reader.check_start(io.BytesIO(data), **wanted).delimiter
    return chosen, rows


def error_of(data: bytes, **kwargs) -> IngestError:
    with pytest.raises(IngestError) as caught:
        rows_of(data, **kwargs)
    return caught.value


def test_comma_semicolon_and_tab_are_detected_from_the_header():
    for sep in (",", ";", "\t"):
        data = f"id{sep}text\n1{sep}hello\n2{sep}world\n".encode()
        chosen, rows = rows_of(data, id_column="id")
        assert chosen == sep
        assert [(r[1], r[2]) for r in rows] == [("1", "hello"), ("2", "world")]


def test_quoted_fields_keep_newlines_and_delimiters():
    data = b'text,id\n"line one\nline two, still the same cell",a\n"say ""hi""",b\n'
    _, rows = rows_of(data, id_column="id")
    assert rows[0][2] == "line one\nline two, still the same cell"
    assert rows[1][2] == 'say "hi"'


def test_utf8_bom_is_accepted_and_gbk_when_asked():
    _, rows = rows_of("\ufefftext\ncafé\n".encode())
    assert rows[0][2] == "café"
    _, rows = rows_of("text\n发票重复扣款\n".encode("gbk"), encoding=check_encoding("gbk"))
    assert rows[0][2] == "发票重复扣款"


def test_undecodable_bytes_name_the_line_and_suggest_the_encoding_field():
    data = b"text\nfine\n" + "发票\n".encode("gbk")
    message = error_of(data).message
    assert message.startswith("line 3: byte 0xb7 at column 1 is not valid utf-8")
    assert "`encoding`" in message


def test_header_problems():
    assert error_of(b"").message == "the file is empty"
    assert error_of(b"\n\n").message == "the file is empty"
    assert error_of(b"text\n").message == "the file has a header but no data rows"
    message = error_of(b"body;lang\nhello;en\n").message
    assert message == "text column 'text' not found; the semicolon-separated header has: 'body', 'lang'"
    assert "id column 'key' not found" in error_of(b"text\nhi\n", id_column="key").message


def test_too_many_rows():
    data = b"text\n" + b"row\n" * 6
    assert error_of(data).message == "the file has more than 5 data rows, the limit per job"


def test_empty_and_oversized_cells_fail_only_their_row():
    _, rows = rows_of(b'text\nok\n"   "\n' + b"x" * 60 + b"\n")
    assert [r[3] for r in rows] == ["", "empty text", "text too long: 60 characters, the limit is 50"]


def test_blank_lines_are_skipped():
    _, rows = rows_of(b"text\na\n\nb\n")
    assert [r[2] for r in rows] == ["a", "b"] and [r[0] for r in rows] == [0, 1]


def test_encoding_and_delimiter_checks():
    with pytest.raises(IngestError, match="unknown encoding 'klingon'"):
        check_encoding("klingon")
    assert check_encoding("UTF8") == "utf-8"
    assert check_encoding("utf-8-sig") == "utf-8"  # the mark is honoured whatever the name
    assert pick_delimiter("a|b", None) == ","
    assert pick_delimiter("a,b", "tab") == "\t"
    with pytest.raises(IngestError, match="delimiter must be one of"):
        pick_delimiter("a,b", "|")


@pytest.mark.parametrize("name", ["rot13", "bz2_codec", "zlib", "base64", "hex", "uu", "quopri", "undefined", "idna"])
def test_only_character_encodings_are_accepted(name):
    with pytest.raises(IngestError) as caught:
        check_encoding(name)
    assert f"encoding {name!r} is not a character encoding" in caught.value.message
    assert "utf-8, utf-16, utf-32, latin-1" in caught.value.message


@pytest.mark.parametrize("codec", ["utf-16", "utf-32", "utf-16-be", "utf-32-be"])
def test_utf16_and_utf32_with_a_bom_split_into_the_right_lines(codec):
    text = 'text,id\nwhere is my parcel,a\n"two\nlines",b\n'
    bom = {"utf-16-be": codecs.BOM_UTF16_BE, "utf-32-be": codecs.BOM_UTF32_BE}.get(codec, b"")
    data = bom + text.encode(codec)
    for given in ("utf-8", codec):  # the byte-order mark decides, whatever the encoding given
        rows = CsvReader(encoding=check_encoding(given)).rows(io.BytesIO(data), columns={"text": "text"},
                                                              id_column="id", limits=LIMITS)  # fmt: skip
        assert [(r[1], r[2]) for r in rows] == [("a", "where is my parcel"), ("b", "two\nlines")]


def test_utf16_without_a_bom_is_a_clear_error_and_utf16le_reads_it():
    data = "text\nhello\n".encode("utf-16-le")
    message = error_of(data, encoding="utf-16").message
    assert message.startswith("encoding 'utf-16' needs a byte-order mark (BOM)") and "utf-16-le" in message
    assert [r[2] for r in rows_of(data, encoding="utf-16-le")[1]] == ["hello"]


def test_undecodable_utf16_names_line_and_column():
    data = codecs.BOM_UTF16_LE + "text\nfine\nab".encode("utf-16-le") + b"\x00\xdc" + "\n".encode("utf-16-le")
    message = error_of(data, encoding="utf-16").message
    assert message.startswith("line 3: byte 0x00 at column 3 is not valid utf-16-le")


def test_an_error_deep_in_a_file_names_its_line():
    data = b"text\n" + b"row\n" * 30_000 + b"\xff\n"
    limits = IngestLimits(max_rows=100_000, max_text_chars=50, batch_rows=2, chunk_rows=2)
    with pytest.raises(IngestError, match="^line 30002: byte 0xff at column 1 is not valid utf-8"):
        list(CsvReader(encoding="utf-8").rows(io.BytesIO(data), columns={"text": "text"}, id_column="",
                                              limits=limits))  # fmt: skip


def test_a_cell_over_the_csv_module_field_limit_fails_only_its_row():
    _, rows = rows_of(b"text\nbefore\n" + b"x" * 300_000 + b"\nafter\n")
    assert [r[3] for r in rows] == ["", "text too long: 300000 characters, the limit is 50", ""]
    assert [r[2] for r in rows][2] == "after"


def test_preflight_reads_only_the_start():
    limits = IngestLimits(max_rows=100_000, max_text_chars=50, batch_rows=2, chunk_rows=2)

    def check(data: bytes):
        return CsvReader(encoding="utf-8").check_start(io.BytesIO(data), columns={"text": "text"}, id_column="",
                                                       limits=limits)  # fmt: skip

    # Bad bytes past the first block (and past PREFLIGHT_ROWS rows) are left for the ingest task...
    rows_past_first_block = BLOCK_BYTES // 5 + PREFLIGHT_ROWS
    parsed = check(b"text\n" + b"fine\n" * rows_past_first_block + b"\xff\n" + b"fine\n" * 10)
    assert parsed.delimiter == "," and parsed.encoding == "utf-8"
    # ...but the first block is decoded whole, so bad bytes in it are refused at once.
    with pytest.raises(IngestError, match="^line 202: byte 0xff"):
        check(b"text\n" + b"fine\n" * (PREFLIGHT_ROWS + 100) + b"\xff\n")
    with pytest.raises(IngestError, match="the file is empty"):
        check(b"")


@pytest.mark.parametrize(
    ("cell", "shown"),
    [("=cmd|' /C calc'!A0", "'=cmd|' /C calc'!A0"), ("+1", "'+1"), ("-2", "'-2"), ("@SUM(A1)", "'@SUM(A1)"),
     ("\tx", "'\tx"), ("\rx", "'\rx"), ("plain", "plain"), ("", "")],
)  # fmt: skip
def test_formula_cells_are_neutralised(cell, shown):
    assert neutralise(cell) == shown
