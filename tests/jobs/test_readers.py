"""Upload readers: built from the upload's fields, checked on the file's start, stored on the job and built again."""

from __future__ import annotations

import codecs
import io

import pytest

from jobs.ingest import IngestError, IngestLimits
from jobs.models import Job
from jobs.readers import CsvReader, from_upload, reader_for

LIMITS = IngestLimits(max_rows=5, max_text_chars=50, batch_rows=2, chunk_rows=2)
WANTED = {"columns": {"text": "body"}, "id_column": "key", "limits": LIMITS}


def stored_and_read_back(fields: dict, data: bytes) -> tuple[dict, list]:
    """What a job stores after the web request checks the file's start, and the rows the worker reads with it."""
    checked = from_upload(fields).check_start(io.BytesIO(data), **WANTED)
    job = Job(**checked.job_fields())
    return checked.job_fields(), [(r.external_id, r.text) for r in reader_for(job).rows(io.BytesIO(data), **WANTED)]


def test_the_detected_delimiter_is_stored_and_used_again():
    stored, rows = stored_and_read_back({}, b"key;body\nk1;hello, world\nk2;bye\n")
    assert stored == {"file_format": "csv", "encoding": "utf-8", "delimiter": ";"}
    assert rows == [("k1", "hello, world"), ("k2", "bye")]


def test_a_delimiter_given_by_name_is_stored_as_its_character():
    stored, rows = stored_and_read_back({"delimiter": "tab"}, b"key\tbody\nk1\thello;there\n")
    assert stored["delimiter"] == "\t" and rows == [("k1", "hello;there")]


def test_the_codec_a_byte_order_mark_chose_is_stored_not_the_one_given():
    data = codecs.BOM_UTF16_LE + "key,body\nk1,café\n".encode("utf-16-le")
    stored, rows = stored_and_read_back({"encoding": "utf-16"}, data)
    assert stored == {"file_format": "csv", "encoding": "utf-16-le", "delimiter": ","} and rows == [("k1", "café")]


def test_the_encoding_field_is_checked_when_the_reader_is_built():
    assert from_upload({"encoding": "UTF8"}) == CsvReader(encoding="utf-8")
    assert from_upload({"encoding": ""}) == CsvReader(encoding="utf-8")
    with pytest.raises(IngestError, match="^unknown encoding 'klingon'"):
        from_upload({"encoding": "klingon"})


def test_checking_the_start_raises_what_reading_would():
    with pytest.raises(IngestError, match="^text column 'body' not found"):
        from_upload({}).check_start(io.BytesIO(b"key,text\nk1,hi\n"), **WANTED)
    with pytest.raises(IngestError, match="^delimiter must be one of"):
        from_upload({"delimiter": "|"}).check_start(io.BytesIO(b"key|body\nk1|hi\n"), **WANTED)
