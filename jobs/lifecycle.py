"""What happens to a job between upload and its end: create, ingest, enqueue, cancel, retry, finish.

Status changes themselves are the models' transition methods (jobs/models.py); this module decides
when to call them and sends the messages that follow.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import IO

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist
from django.db import IntegrityError, transaction
from django.db.models import Count, Q
from django.utils import timezone

from inference.core.registry import ModelSpec, get_registry
from inference.core.task_io import takes_text
from inference.core.tokens import token_counts
from jobs import enqueue, files, quotas, readers, scheduler, versions
from jobs.files import PartsGone, PartsReader
from jobs.ingest import IngestError, IngestLimits, in_task_order, input_columns, shown
from jobs.models import Batch, Chunk, FileFormat, FilePart, Job, JobRow, JobStatus, Priority, RowStatus, UploadPart
from platform_.db import lock_user
from platform_.errors import ApiError

logger = logging.getLogger(__name__)
# Bytes per stored slice of an upload: one row each, read back one at a time by the ingest task.
UPLOAD_PART_BYTES = files.PART_BYTES


def ingest_limits() -> IngestLimits:
    return IngestLimits(
        max_rows=settings.JOBS_MAX_ROWS,
        max_text_chars=settings.JOBS_MAX_TEXT_CHARS,
        batch_rows=settings.JOBS_INGEST_BATCH_ROWS,
        chunk_rows=settings.JOBS_CHUNK_ROWS,
    )


def create_job(
    *,
    owner,
    model: str,
    upload: IO[bytes],
    filename: str,
    text_column: str = "",
    columns: Mapping[str, str] | None = None,
    id_column: str = "",
    encoding: str = "utf-8",
    delimiter: str | None = None,
    callback_url: str = "",
    priority: str = Priority.NORMAL,
    file_format: str = FileFormat.CSV,
    api_key_id: int | None = None,
) -> Job:
    """Check the file's start, store it and queue its ingest; the job answers `ingesting`.

    `columns` are the upload's other `<field>_column` values (`question_column`, `context_column`);
    which of them the model's task needs is `ingest.input_columns`'s to say. The checks that need only
    the header and the first rows raise IngestError here, before anything is created; problems further
    into the file fail the job later with the same messages.
    """
    try:
        model, pinned = versions.model_and_version(model)  # `router@2` pins the job to version 2
    except versions.UnknownVersion as unknown:
        raise IngestError(str(unknown), field="model") from None
    spec = get_registry().get(model)
    if spec is None:
        raise IngestError(
            f"unknown model {shown(model)}; served models: {', '.join(get_registry().names())}", field="model"
        )
    mapping = input_columns(model, spec.task, {**(columns or {}), "text_column": text_column})
    share = quotas.share_of(owner)
    quotas.check_priority(share, priority)
    # Checked here too, unlocked, so that a user at a quota hears so before their file is looked at.
    check_admission(owner, share)
    reader = readers.from_upload({"encoding": encoding, "delimiter": delimiter, "file_format": file_format})
    checked = reader.check_start(upload, columns=mapping, id_column=id_column, limits=ingest_limits())
    upload.seek(0)
    # Text tasks keep their column in `text_column`, as every job before structured inputs did.
    structured = not takes_text(spec.task)
    with transaction.atomic():
        # Again under the owner's lock, in the transaction that creates the job: the check that counts.
        lock_user(owner)
        check_admission(owner, share)
        job = Job.objects.create(
            owner=owner,
            api_key_id=api_key_id,
            model=model,
            model_version=pinned,  # "": the active version, pinned by jobs/versions.py as the row is saved
            filename=filename[:255],
            text_column="" if structured else mapping["text"],
            input_columns=mapping if structured else {},
            id_column=id_column,
            **checked.job_fields(),  # what the file's start showed (a detected delimiter), read again at ingest
            callback_url=callback_url,
            priority=priority,
            status=JobStatus.INGESTING,
            ingest_progress_at=timezone.now(),
        )
        job.upload_bytes = store_upload(job, upload)
        Job.objects.filter(pk=job.pk).update(upload_bytes=job.upload_bytes)
    ingest_soon(job)
    return job


def check_admission(owner, share: quotas.Share) -> None:
    """The per-user limits a new job must pass (IngestError, 429, naming the limit). Atomic only inside a
    transaction holding `platform_.db.lock_user(owner)`, through to the job's creation."""
    quotas.check_new_job(owner, share)
    check_reading(owner)


def check_reading(owner) -> None:
    """429 when the user has JOBS_MAX_INGESTING_PER_USER files being read already.

    Ingests run on the offline worker one at a time: one user queueing dozens would hold every other
    user's upload behind them.
    """
    reading = Job.objects.filter(owner=owner, status=JobStatus.INGESTING).count()
    if reading >= settings.JOBS_MAX_INGESTING_PER_USER:
        raise IngestError(
            f"you already have {reading} uploads being read (the limit is {settings.JOBS_MAX_INGESTING_PER_USER}"
            " per user); wait until one is queued, or cancel one",
            status=429,
        )


def ingest_soon(job: Job) -> None:
    """Read the job's stored file: here and now when it is small, else by an offline worker.

    A small file is read in the request, so its chunks reach the fair share at once: an ingest message
    would wait on the offline child behind the batch it is running (seconds beside a big job), longer
    than the small job itself. A request that dies here leaves the job `ingesting` with its file
    stored, and the reconciler queues its ingest.
    """
    if job.upload_bytes <= settings.JOBS_INLINE_INGEST_BYTES:
        try:
            run_ingest(job.pk)
        except Exception:  # the job exists already: an offline worker reads it instead, no 500 for the client
            logger.exception("job %s: reading the small file in the request failed; queued for a worker", job.pk)
            Job.objects.filter(pk=job.pk, status=JobStatus.INGESTING).update(ingest_claimed_at=None)
            enqueue_ingest(job.pk)
        try:
            job.refresh_from_db()
        except Job.DoesNotExist:  # deleted meanwhile, with its owner: answered as it was created
            pass
    else:
        enqueue_ingest(job.pk)


def store_upload(job: Job, upload: IO[bytes]) -> int:
    """Copy the upload into the database in slices; its size in bytes."""
    create = lambda seq, data: UploadPart.objects.create(job=job, seq=seq, data=data)  # noqa: E731
    return files.write_slices(create, upload, UPLOAD_PART_BYTES)[0]


def enqueue_ingest(job_id: int) -> None:
    enqueue.ingest_after_commit(job_id)


def _stored_parts(job: Job):
    """The slices the job's file is read from: its own upload's, or (a batch) its input file's."""
    if job.file_format == FileFormat.BATCH:
        file_id = Batch.objects.filter(job=job).values_list("input_file_id", flat=True).first()
        if file_id is None:  # the input file was deleted (the batch keeps no link to it)
            raise PartsGone
        return FilePart.objects.filter(file_id=file_id)
    return UploadPart.objects.filter(job=job)


def upload_stored(job: Job) -> bool:
    """Whether the file the job's ingest reads is still stored (the reconciler asks before queuing it again)."""
    try:
        return _stored_parts(job).exists()
    except PartsGone:
        return False


class _Stop(Exception):
    """This worker no longer holds the ingest (cancelled, failed, or claimed by another)."""


def run_ingest(job_id: int) -> None:
    """Read a job's stored upload into rows and chunks, then queue the chunks (in an offline worker).

    Rows go in committed batches with progress noted after each; a worker that dies leaves the job
    `ingesting`, and the reconciler queues the ingest again, which starts over. A file problem fails
    the job with the message a 400 would have carried.

    A job deleted while it is read (its owner deleted, and the job with them) ends the read with one
    log line: its rows' inserts then break their foreign key and its own row is gone, which is no
    fault of the worker, and the job has nobody left to tell.
    """
    try:
        _ingest(job_id)
    except (IntegrityError, ObjectDoesNotExist):
        if Job.objects.filter(pk=job_id).exists():
            raise
        logger.info("ingest of job %s stopped: the job was deleted while its file was read", job_id)


def _ingest(job_id: int) -> None:
    job = Job.claim_ingest(job_id, settings.JOBS_STALL_S)
    if job is None:
        return  # ingested, cancelled, or another worker is on it: a duplicate message
    limits = ingest_limits()
    JobRow.objects.filter(job=job).delete()  # what an interrupted earlier attempt wrote
    reader = readers.reader_for(job)
    try:
        upload = PartsReader(_stored_parts(job))
        if reader.validate(PartsReader(_stored_parts(job)), limits=limits) is not None:
            # A batch whose every line passed: `in_progress` from here, while its rows are written.
            Batch.objects.filter(job=job, in_progress_at__isnull=True).update(in_progress_at=timezone.now())
        costs = _write_rows(job, reader, upload, limits)
        total = sum(len(c) for c in costs)
        now = timezone.now()
        chunks = [
            Chunk(
                job=job,
                first_index=start,
                end_index=min(start + limits.chunk_rows, total),
                enqueued_at=now,
                cost_tokens=sum(costs[n]),
            )
            for n, start in enumerate(range(0, total, limits.chunk_rows))
        ]
        with transaction.atomic():
            quotas.check_ingested(job, total)
            Chunk.objects.bulk_create(chunks)
            if not job.queue(total):
                raise _Stop
            Batch.objects.filter(job=job, in_progress_at__isnull=True).update(in_progress_at=timezone.now())
            UploadPart.objects.filter(job=job).delete()
            job.refresh_counts()
            scheduler.refill_after_commit()
    except IngestError as error:
        JobRow.objects.filter(job=job).delete()
        if job.file_format == FileFormat.BATCH and not upload_stored(job):
            # Deleted while it was being read: what was read looked cut short ("the file is empty").
            job.fail("the batch's input file was deleted before it was read")
        else:
            job.fail(error.message, error.details)
    except PartsGone:
        job.refresh_from_db()
        if job.status == JobStatus.INGESTING and job.file_format == FileFormat.BATCH:
            JobRow.objects.filter(job=job).delete()
            job.fail("the batch's input file was deleted before it was read")
    except _Stop:
        job.refresh_from_db()
        if job.status == JobStatus.CANCELLED:
            JobRow.objects.filter(job=job).delete()  # nothing ran: the cancelled job keeps no half-read rows
        logger.info("ingest of job %s stopped: the job is %s", job.pk, job.status)


def job_columns(job: Job) -> dict[str, str]:
    """Input field -> CSV column of a job, in its task's field order: its `input_columns`, or
    {"text": text_column} for text tasks."""
    if not job.input_columns:
        return {"text": job.text_column}
    return {field: job.input_columns[field] for field in in_task_order(job.input_columns)}


def price(spec: ModelSpec | None, inputs: list) -> list[int]:
    """Tokens each input will cost the model (what the fair share charges a chunk for); an input the
    tokenizer refuses (its row fails when run) is priced by its length, and nothing is raised here."""
    if spec is None or not inputs:
        return [1] * len(inputs)
    try:
        return token_counts(spec, inputs)
    except ApiError:  # an input its tokenizer refuses
        pass
    except Exception:  # no tokenizer to read (a misconfigured model): its rows fail when run, not the ingest
        logger.warning(
            "pricing rows of model %r by length: its tokenizer could not count them", spec.name, exc_info=True
        )
    return [max(1, len(str(item)) // 4) for item in inputs]


def _write_rows(job: Job, reader: readers.Reader, upload: PartsReader, limits: IngestLimits) -> list[list[int]]:
    """Write the file's rows; each chunk's rows' prices in tokens (chunk n holds rows n * chunk_rows on)."""
    spec = get_registry().get(job.model)
    rows = reader.rows(upload, columns=job_columns(job), id_column=job.id_column, limits=limits)
    batch: list[JobRow] = []
    total = 0
    prices: list[int] = []

    # A text task's input is the row's text (a batch line may keep request options in `inputs`).
    text_input = spec is None or takes_text(spec.task)

    def flush() -> int:
        runnable = [(i, r.text if text_input else r.inputs) for i, r in enumerate(batch) if not r.error]
        priced = price(spec, [item for _, item in runnable])
        costs = [0] * len(batch)  # a row that failed at ingest costs the model nothing
        for (i, _), cost in zip(runnable, priced, strict=True):
            costs[i] = batch[i].tokens = cost
        prices.extend(costs)
        return _flush(job, batch, total, upload)

    for row in rows:
        status = RowStatus.FAILED if row.error else RowStatus.PENDING
        batch.append(
            JobRow(
                job=job,
                index=row.index,
                external_id=row.external_id,
                text=row.text,
                inputs=row.inputs,
                status=status,
                error=row.error,
                input_error=bool(row.error),  # a property of the file: a retry would fail it again
            )
        )
        if len(batch) >= limits.batch_rows:
            total = flush()
            batch = []
    if batch:
        total = flush()
    return [prices[start : start + limits.chunk_rows] for start in range(0, total, limits.chunk_rows)]


def _flush(job: Job, batch: list[JobRow], total: int, upload: PartsReader) -> int:
    JobRow.objects.insert(batch)
    total += len(batch)
    if not job.record_ingest(total, upload.bytes_read):
        raise _Stop
    return total


def cancel(job: Job) -> bool:
    """Stop a job: remaining chunks are not run, rows done so far are kept. False if it had already ended."""
    return job.cancel()


@dataclass(frozen=True)
class RetryOffer:
    """What a retry of a job would do with its failed rows: those it runs again, and those it leaves."""

    rows: int  # failed at run time (a worker or model error): may succeed when run again
    input_rows: int  # failed because of their input (JobRow.input_error): would only fail again
    input_reasons: str  # their problems, most frequent first: "empty text", or "40 empty text, 5 text too long"

    @property
    def input_note(self) -> str:
        """What the person should do about the rows a retry leaves ("" when there are none)."""
        if not self.input_rows:
            return ""
        rows, their = ("1 row", "its") if self.input_rows == 1 else (f"{self.input_rows:,} rows", "their")
        return f"{rows} failed because of {their} input ({self.input_reasons}): fix the file and upload it again"


# Problems named in a RetryOffer's reasons; the rest are counted as "other".
SHOWN_INPUT_REASONS = 3
# Distinct error messages read to name them (a long text's message carries its length: many differ).
READ_INPUT_ERRORS = 50


def retry_offer(job: Job) -> RetryOffer:
    """How many of the job's failed rows a retry would run again, and what is wrong with the others.

    Counted whatever the job's status (after a retry, the rows it left); whether a retry may start at all
    (an ended job, not a batch) is `Job.retryable`'s to say.
    """
    if not job.failed_rows or job.file_format == FileFormat.BATCH:
        return RetryOffer(0, 0, "")
    counts = job.rows.filter(status=RowStatus.FAILED).aggregate(
        run=Count("pk", filter=Q(input_error=False)), input=Count("pk", filter=Q(input_error=True))
    )
    reasons = ""
    if counts["input"]:
        errors = (
            job.rows.filter(status=RowStatus.FAILED, input_error=True)
            .values("error")
            .annotate(n=Count("pk"))
            .order_by("-n", "error")[:READ_INPUT_ERRORS]
        )
        reasons = _reasons_text(errors, counts["input"])
    return RetryOffer(counts["run"], counts["input"], reasons)


def _reasons_text(errors: Iterable[dict], total: int) -> str:
    """ "empty text" when the rows share one problem; else "40 empty text, 5 text too long, 2 other"."""
    kinds: Counter[str] = Counter()
    for item in errors:
        # "text too long: 5,012 characters, the limit is 4,096" -> "text too long": one kind whatever the length.
        # Numbers before the first ":" or ";" ("question is 612 tokens; ...") would make each count a kind of its own.
        kind = re.sub(r"\d[\d,.]*", "N", re.split(r"[:;]", item["error"], maxsplit=1)[0]).strip()[:80] or "no message"
        kinds[kind] += item["n"]
    if len(kinds) == 1 and kinds.total() == total:
        return next(iter(kinds))
    shown = kinds.most_common(SHOWN_INPUT_REASONS)
    parts = [f"{n:,} {kind}" for kind, n in shown]
    if rest := total - sum(n for _, n in shown):
        parts.append(f"{rest:,} other")
    return ", ".join(parts)


def no_retry_reason(job: Job, offer: RetryOffer) -> str:
    """Why a retry of an ended job runs no row, for the API's 409 and the page's and admin's messages.
    `job` is read after the retry: one that is live again was retried by a concurrent request."""
    if not job.is_terminal:
        return f"job {job.pk} is {job.status} again: another retry has just queued its failed rows"
    if offer.input_rows:
        return f"job {job.pk} has no rows that a retry could help: {offer.input_note}"
    return f"job {job.pk} has no failed rows to retry"


def retry_failed(job: Job) -> int:
    """Re-run the rows of an ended job that failed at run time; returns how many rows were queued again.

    Rows that failed because of their input stay failed (`retry_offer` says how many, and why). The job
    ends again once the others have run; its callback announces that end only if the outcome changed
    (a retry whose rows all fail again is not announced twice: jobs/callbacks.py, schedule)."""
    requeued, chunks = job.requeue_failed()
    if chunks:
        scheduler.refill_after_commit()
    return requeued


def finish_if_done(job_id: int) -> None:
    """Give a job its terminal status once no chunk is left to run."""
    Job.objects.get(pk=job_id).finish()


def mark_started(job_ids: Iterable[int]) -> None:
    Job.start(job_ids)


def rows_of(chunks: Iterable[Chunk]) -> Q:
    """A filter for the rows of these chunks."""
    q = Q(pk__in=[])
    for chunk in chunks:
        q |= Q(job_id=chunk.job_id, index__gte=chunk.first_index, index__lt=chunk.end_index)
    return q


def pending_rows(chunks: list[Chunk]) -> list[JobRow]:
    """The rows of these chunks still to run, with every field the runner reads or writes loaded.

    A deferred field costs a query per row the first time it is read: `status` and `attempts` left
    out cost two SELECTs per row, which was a tenth of the offline child's time.
    """
    fields = ("pk", "job_id", "index", "text", "inputs", "status", "attempts", "input_error")
    return list(JobRow.objects.filter(rows_of(chunks), status=RowStatus.PENDING).only(*fields))
