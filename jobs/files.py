"""Stored bytes: the slices of uploads and of the OpenAI Files API's files, written once and streamed back.

Both kinds live in the database in slices of PART_BYTES (UploadPart for a job's own upload until it is
read; FilePart for a `file-...` of the Files API), because web and workers may run on different hosts
and the database is the one store all of them reach. Nothing here reads a whole file into memory: a
file goes in a slice at a time and comes back as a stream of slices.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import IO

from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from jobs.models import FilePart, Job, StoredFile

# Bytes per stored slice: one row each, read back one at a time.
PART_BYTES = 1024 * 1024


def new_public_id(prefix: str) -> str:
    """An id as OpenAI's look (`file-<hex>`, `batch_<hex>`): unguessable, so that ids say nothing of volume."""
    return f"{prefix}{secrets.token_hex(12)}"


class PartsGone(Exception):
    """A slice disappeared while being read: its file or job was deleted, cancelled or failed meanwhile."""


class PartsReader:
    """A binary stream over stored slices (any model with `seq` and `data`), read in `seq` order.

    Tracks `bytes_read`, which ingest reports as its progress.
    """

    def __init__(self, parts: QuerySet) -> None:
        self.parts = parts
        self.count = parts.count()
        self.seq = 0
        self.part = b""
        self.offset = 0  # into self.part
        self.bytes_read = 0

    def read(self, size: int = -1) -> bytes:
        """Up to `size` bytes (fewer only at the end); b"" at the end."""
        wanted = size if size >= 0 else 1 << 62
        out: list[bytes] = []
        got = 0
        while got < wanted:
            if self.offset >= len(self.part):
                if self.seq >= self.count:
                    break
                data = self.parts.filter(seq=self.seq).values_list("data", flat=True).first()
                if data is None:
                    raise PartsGone
                self.part, self.offset, self.seq = bytes(data), 0, self.seq + 1
            piece = self.part[self.offset : self.offset + wanted - got]
            self.offset += len(piece)
            got += len(piece)
            out.append(piece)
        self.bytes_read += got
        return b"".join(out)


def write_slices(
    create: Callable[[int, bytes], object], upload: IO[bytes], part_bytes: int = PART_BYTES
) -> tuple[int, int]:
    """Copy `upload` into slices of `part_bytes`, `create(seq, data)` storing each; (bytes, lines) copied."""
    size = lines = seq = 0
    last = b"\n"
    while block := upload.read(part_bytes):
        create(seq, block)
        seq += 1
        size += len(block)
        lines += block.count(b"\n")
        last = block[-1:]
    return size, lines + (0 if last == b"\n" else 1)


def store_upload(owner, purpose: str, filename: str, upload: IO[bytes], expires_at: datetime | None) -> StoredFile:
    """An uploaded file stored in slices, with its size and number of lines."""
    with transaction.atomic():
        stored = StoredFile.objects.create(
            public_id=new_public_id("file-"),
            owner=owner,
            purpose=purpose,
            filename=filename[:255],
            expires_at=expires_at,
        )
        stored.bytes, stored.lines = write_slices(
            lambda seq, data: FilePart.objects.create(file=stored, seq=seq, data=data), upload
        )
        StoredFile.objects.filter(pk=stored.pk).update(bytes=stored.bytes, lines=stored.lines)
    return stored


def write_lines(owner, purpose: str, filename: str, lines: Iterable[str], job: Job | None = None) -> StoredFile:
    """A file written from generated lines (a batch's output), a slice at a time."""
    with transaction.atomic():
        stored = StoredFile.objects.create(
            public_id=new_public_id("file-"), owner=owner, purpose=purpose, filename=filename[:255], job=job
        )
        pending: list[bytes] = []
        pending_bytes = size = count = seq = 0
        for line in lines:
            data = line.encode()
            pending.append(data)
            pending_bytes += len(data)
            count += 1
            if pending_bytes >= PART_BYTES:
                FilePart.objects.create(file=stored, seq=seq, data=b"".join(pending))
                seq, size, pending, pending_bytes = seq + 1, size + pending_bytes, [], 0
        if pending:
            FilePart.objects.create(file=stored, seq=seq, data=b"".join(pending))
            size += pending_bytes
        stored.bytes, stored.lines = size, count
        StoredFile.objects.filter(pk=stored.pk).update(bytes=size, lines=count)
    return stored


def content(stored: StoredFile) -> Iterator[bytes]:
    """The file's bytes, a slice at a time (what a download streams)."""
    for seq in FilePart.objects.filter(file=stored).order_by("seq").values_list("seq", flat=True):
        data = FilePart.objects.filter(file=stored, seq=seq).values_list("data", flat=True).first()
        if data is None:
            return  # deleted while being read: the download ends short, as a cut connection would
        yield bytes(data)


def reader(stored: StoredFile) -> PartsReader:
    return PartsReader(FilePart.objects.filter(file=stored))


def visible(owner) -> QuerySet[StoredFile]:
    """The owner's files, less those past their expiry (deleted by the next retention run)."""
    now = timezone.now()
    return StoredFile.objects.filter(owner=owner).filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))


def expired_uploads(now: datetime) -> QuerySet[StoredFile]:
    """Uploaded files past their `expires_at` (a batch already created from one keeps its own rows)."""
    return StoredFile.objects.filter(expires_at__lt=now, job__isnull=True)
