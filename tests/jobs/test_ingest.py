"""CSV reading: delimiters, encodings, quoting, and errors that name the line and the problem."""

from __future__ import annotations

import io

import pytest

from jobs.ingest import IngestError, IngestLimits, check_encoding, pick_delimiter, read_rows

LIMITS = IngestLimits(max_rows=5, max_text_chars=50, batch_rows=2, chunk_rows=2)


def rows_of(data: bytes, text_column="text", id_column="", encoding="utf-8-sig", delimiter=None):
    chosen, rows = read_rows(
        io.BytesIO(data),
        encoding=encoding,
        text_column=text_column,
        id_column=id_column,
        delimiter=delimiter,
        limits=LIMITS,
    )
    return chosen, list(rows)


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
    assert check_encoding("UTF8") == "utf-8-sig"
    assert pick_delimiter("a|b", None) == ","
    assert pick_delimiter("a,b", "tab") == "\t"
    with pytest.raises(IngestError, match="delimiter must be one of"):
        pick_delimiter("a,b", "|")
