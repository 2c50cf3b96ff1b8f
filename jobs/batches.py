"""The OpenAI Batch API over offline jobs: a batch is a job, plus a Batch row saying what OpenAI's API says.

A batch's input file (jobs/files.py) is read by the job's ingest with the batch request reader
(jobs/readers.BatchRequestReader): validation is that ingest, so a batch is `validating` while its job
is `ingesting`. Its lines are the job's rows and run as any job's do (fair share, crash survival,
cancel). When the job ends, the finalizer (a housekeeping thread of the offline worker's main process,
never the child that runs rows) writes the output and error files from the rows, then the batch is
`completed`, `expired`, `cancelled` or `failed` and its callback (`batch.<status>`) goes out.

Statuses are derived, never stored twice: from the job's status and the batch's own times
(`batch_status`). Plain functions here; the HTTP views are jobs/api/openai_batches.py.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from inference.core.registry import get_registry
from jobs import files, lifecycle, quotas
from jobs.ingest import DecodedLines, json_line_chars, storable
from jobs.models import (
    TERMINAL,
    Batch,
    FileFormat,
    FilePurpose,
    Job,
    JobRow,
    JobStatus,
    RowStatus,
    StoredFile,
)
from jobs.readers import EMBEDDINGS_ENDPOINT
from jobs.signals import batch_finalized
from platform_.db import lock_user

logger = logging.getLogger(__name__)
COMPLETION_WINDOWS = ("24h",)
_PREDICT = re.compile(r"^/api/v1/models/(?P<model>[^/]+)/predict$")
# The finalizer's Periodic name (its lock: `periodic:<name>:lock`, platform_/periodic.py).
FINALIZER = "jobs-batch-finalizer"


class BatchRefused(Exception):
    """A batch that cannot be created: status, OpenAI error code, message and the parameter to blame."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def id_like(value: Any) -> bool:
    """Whether `value` could be an id at all (a string the database can compare): anything else is not found."""
    return isinstance(value, str) and len(value) <= 100 and _text(value)


def endpoints_served() -> list[str]:
    registry = get_registry()
    return [EMBEDDINGS_ENDPOINT, *(f"/api/v1/models/{name}/predict" for name in registry.names())]


def check_endpoint(endpoint: Any) -> str | None:
    """The model a predict endpoint names (None for /v1/embeddings, whose lines name it); 400 otherwise."""
    if endpoint == EMBEDDINGS_ENDPOINT:
        return None
    match = _PREDICT.match(endpoint) if isinstance(endpoint, str) else None
    if match and get_registry().get(match["model"]) is not None:
        return match["model"]
    raise BatchRefused(
        400,
        "invalid_value",
        f"`endpoint` must be {EMBEDDINGS_ENDPOINT} or /api/v1/models/<model>/predict for a served model "
        f"({', '.join(endpoints_served())}); got {str(endpoint)[:120]!r}",
        "endpoint",
    )


def first_line_model(stored: StoredFile) -> str:
    """`body.model` of the file's first line ("" when it has none): an embeddings batch runs that model, and
    its validation says so for every line that names another."""
    try:
        lines = DecodedLines(files.reader(stored), "utf-8", json_line_chars(settings.JOBS_MAX_TEXT_CHARS))
        line = next((line for line in lines if line.strip()), "")
        model = json.loads(line).get("body", {}).get("model")
    except Exception:  # any problem with the line is the validation's to report, with its line number
        return ""
    return model[:100] if isinstance(model, str) else ""


def create_batch(
    owner,
    *,
    input_file_id: Any,
    endpoint: Any,
    completion_window: Any,
    metadata: Any = None,
    callback_url: str = "",
) -> Batch:
    """Create a batch from a stored `purpose=batch` file; it answers `validating` (or, for a small file read
    at once, already `in_progress` or `failed`)."""
    stored = files.visible(owner).filter(public_id=input_file_id).first() if id_like(input_file_id) else None
    if stored is None:
        raise BatchRefused(404, "not_found", f"No such File object: {str(input_file_id)[:80]}", "input_file_id")
    if stored.purpose != FilePurpose.BATCH:
        raise BatchRefused(
            400,
            "invalid_value",
            f"file {stored.public_id} has purpose {stored.purpose!r}, not 'batch'",
            "input_file_id",
        )
    if completion_window not in COMPLETION_WINDOWS:
        raise BatchRefused(
            400,
            "invalid_value",
            f"`completion_window` must be '24h', got {str(completion_window)[:40]!r}",
            "completion_window",
        )
    _check_metadata(metadata)
    model = check_endpoint(endpoint) or first_line_model(stored)
    share = quotas.share_of(owner)
    lifecycle.check_admission(owner, share)
    now = timezone.now()
    with transaction.atomic():
        lock_user(owner)  # the check again, atomic with the job's creation (lifecycle.create_job says why)
        lifecycle.check_admission(owner, share)
        job = Job.objects.create(
            owner=owner,
            model=model,
            filename=stored.filename,
            file_format=FileFormat.BATCH,
            upload_bytes=stored.bytes,
            callback_url=callback_url,
            status=JobStatus.INGESTING,
            ingest_progress_at=now,
        )
        batch = Batch.objects.create(
            public_id=files.new_public_id("batch_"),
            job=job,
            endpoint=endpoint,
            completion_window=completion_window,
            metadata=metadata,
            input_file=stored,
            expires_at=now + timedelta(seconds=settings.JOBS_BATCH_WINDOW_S),
        )
    lifecycle.ingest_soon(job)
    batch.refresh_from_db()
    return batch


def _check_metadata(metadata: Any) -> None:
    """OpenAI's rule: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise BatchRefused(400, "invalid_value", "`metadata` must be an object of at most 16 pairs", "metadata")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512 or not _text(key) or not _text(value):
            raise BatchRefused(
                400,
                "invalid_value",
                "`metadata` keys must be at most 64 characters and its values strings of at most 512, of text "
                "(no NUL, no lone surrogate)",
                "metadata",
            )


def _text(value: str) -> bool:
    """Whether the database can store `value` as it is (no NUL, no lone surrogate)."""
    return storable(value) == value


def batch_status(batch: Batch) -> str:
    """OpenAI's status of the batch, from its job's status and its own times."""
    status = batch.job.status
    if batch.finalized_at is not None:
        if status == JobStatus.FAILED and batch.job.total_rows == 0:
            return "failed"  # failed before any line ran: validation
        return {JobStatus.EXPIRED: "expired", JobStatus.CANCELLED: "cancelled"}.get(status, "completed")
    if status in (JobStatus.PENDING, JobStatus.INGESTING):
        # Every line passed validation once in_progress_at is set; the rows are then being written.
        return "in_progress" if batch.in_progress_at else "validating"
    if status in (JobStatus.QUEUED, JobStatus.RUNNING):
        return "in_progress"
    if status == JobStatus.CANCELLED:
        return "cancelling"
    return "finalizing"


def _unix(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value else None


def request_counts(batch: Batch) -> dict[str, int]:
    """total, completed and failed requests; once an expired or cancelled batch is final, the lines it never
    ran count as failed (they are in its error file), so completed + failed = total."""
    job = batch.job
    failed = job.failed_rows
    if batch.finalized_at and job.status in (JobStatus.EXPIRED, JobStatus.CANCELLED):
        failed = job.total_rows - job.done_rows
    return {"total": job.total_rows, "completed": job.done_rows, "failed": failed}


def batch_object(batch: Batch) -> dict[str, Any]:
    """The batch as OpenAI's API shows it."""
    job = batch.job
    status = batch_status(batch)
    ended = job.finished_at if batch.finalized_at else None
    errors = None
    if job.error_details:
        errors = {"object": "list", "data": job.error_details}
    elif status == "failed":
        errors = {
            "object": "list",
            "data": [{"code": "invalid_file", "message": job.error, "param": None, "line": None}],
        }
    return {
        "id": batch.public_id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": job.model or None,
        "errors": errors,
        "input_file_id": batch.input_file.public_id if batch.input_file else None,
        "completion_window": batch.completion_window,
        "status": status,
        "output_file_id": batch.output_file.public_id if batch.output_file else None,
        "error_file_id": batch.error_file.public_id if batch.error_file else None,
        "created_at": _unix(job.created_at),
        "in_progress_at": _unix(batch.in_progress_at),
        "expires_at": _unix(batch.expires_at),
        "finalizing_at": _unix(batch.finalizing_at),
        "completed_at": _unix(batch.finalized_at) if status == "completed" else None,
        "failed_at": _unix(ended) if status == "failed" else None,
        "expired_at": _unix(ended) if status == "expired" else None,
        "cancelling_at": _unix(batch.cancelling_at),
        "cancelled_at": _unix(batch.finalized_at) if status == "cancelled" else None,
        "request_counts": request_counts(batch),
        "metadata": batch.metadata,
        # The platform's own: the job underneath (its page, rows and admin review).
        "job_id": job.pk,
    }


def cancel_batch(batch: Batch) -> bool:
    """Stop the batch: lines not yet run are not run; those done stay in its output file. False if it had ended."""
    if batch.job.is_terminal:
        return False
    Batch.objects.filter(pk=batch.pk, cancelling_at__isnull=True).update(cancelling_at=timezone.now())
    return lifecycle.cancel(batch.job)


# --- output and error files ----------------------------------------------------------------------


def _request_id(batch: Batch, row: JobRow) -> str:
    return f"batch_req_{batch.public_id.removeprefix('batch_')}_{row.index}"


def success_body(batch: Batch, row: JobRow) -> dict[str, Any]:
    """The line's answer exactly as the synchronous endpoint gives it (predict without its per-call `timing`
    and `worker`, which belong to one HTTP call)."""
    job = batch.job
    version = row.model_version or job.model_version
    if batch.endpoint == EMBEDDINGS_ENDPOINT:
        from inference.web.api.openai_compat import embeddings_body

        encoding = (row.inputs or {}).get("encoding_format", "float") if isinstance(row.inputs, dict) else "float"
        # The version that answered this line, as the synchronous answers carry it (issue 21).
        return {**embeddings_body(job.model, [row.output], [row.tokens], encoding), "model_version": version}
    return {"model": job.model, "model_version": version, "outputs": [row.output]}


def error_body(batch: Batch, row: JobRow) -> tuple[int, dict[str, Any]]:
    """(status, body) of a failed line as the synchronous endpoint answers: 400 for an input it refuses,
    500 when the model failed on it."""
    status = 500 if row.error.startswith("inference failed") else 400
    if batch.endpoint == EMBEDDINGS_ENDPOINT:
        kind = "server_error" if status == 500 else "invalid_request_error"
        code = "inference_failed" if status == 500 else "invalid_value"
        return status, {"error": {"message": row.error, "type": kind, "param": "input", "code": code}}
    return status, {"detail": row.error, "code": "inference_failed" if status == 500 else "invalid_input"}


def _line(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False) + "\n"


def output_lines(batch: Batch) -> Iterator[str]:
    """One line per request answered 200, in the file's order."""
    rows = batch.job.rows.filter(status=RowStatus.DONE).order_by("index")
    for row in rows.iterator(chunk_size=500):
        request_id = _request_id(batch, row)
        response = {"status_code": 200, "request_id": request_id, "body": success_body(batch, row)}
        yield _line({"id": request_id, "custom_id": row.external_id, "response": response, "error": None})


_NOT_RUN = {
    JobStatus.EXPIRED: ("batch_expired", "This request could not be executed before the completion window expired."),
    JobStatus.CANCELLED: ("batch_cancelled", "This request was not executed: the batch was cancelled."),
}


def error_lines(batch: Batch) -> Iterator[str]:
    """One line per request that failed (its error answer) or never ran (expired, cancelled), in file order."""
    rows = batch.job.rows.filter(status__in=[RowStatus.FAILED, RowStatus.CANCELLED, RowStatus.PENDING])
    not_run = _NOT_RUN.get(batch.job.status, ("batch_cancelled", "This request was not executed."))
    for row in rows.order_by("index").iterator(chunk_size=2000):
        request_id = _request_id(batch, row)
        if row.status == RowStatus.FAILED:
            status, body = error_body(batch, row)
            response = {"status_code": status, "request_id": request_id, "body": body}
            yield _line({"id": request_id, "custom_id": row.external_id, "response": response, "error": None})
        else:
            error = {"code": not_run[0], "message": not_run[1]}
            yield _line({"id": request_id, "custom_id": row.external_id, "response": None, "error": error})


def finalize(batch: Batch) -> bool:
    """Write the output and error files of a batch whose job has ended, then call back. False when another
    finalizer holds it (or it was finalized already)."""
    now = timezone.now()
    stale = now - timedelta(seconds=settings.JOBS_STALL_S)
    claimable = Batch.objects.filter(pk=batch.pk, finalized_at__isnull=True, job__status__in=TERMINAL)
    if not (
        claimable.filter(finalizing_at__isnull=True).update(finalizing_at=now)
        or claimable.filter(finalizing_at__lt=stale).update(finalizing_at=now)
    ):
        return False
    batch.refresh_from_db()
    job = batch.job
    output = errors = None
    if job.total_rows:
        stem = batch.public_id
        with transaction.atomic():
            # What an earlier finalizer that died part-way wrote is replaced.
            StoredFile.objects.filter(job=job).delete()
            if job.done_rows:
                output = files.write_lines(
                    job.owner, FilePurpose.BATCH_OUTPUT, f"{stem}_output.jsonl", output_lines(batch), job
                )
            if job.done_rows < job.total_rows:
                errors = files.write_lines(
                    job.owner, FilePurpose.BATCH_OUTPUT, f"{stem}_error.jsonl", error_lines(batch), job
                )
    Batch.objects.filter(pk=batch.pk).update(output_file=output, error_file=errors, finalized_at=timezone.now())
    batch.refresh_from_db()
    logger.info("batch %s (job %s) finalized: %s", batch.public_id, job.pk, batch_status(batch))
    batch_finalized.send(sender=Batch, job=job)  # its callback announces the end, now that its files exist
    return True


def expire_overdue(now: datetime) -> int:
    """Stop the batches past their completion window; their lines done so far are kept. How many."""
    expired = 0
    overdue = Batch.objects.filter(expires_at__lt=now).exclude(job__status__in=TERMINAL).select_related("job")
    for batch in overdue:
        expired += batch.job.expire()
    return expired


def run() -> int:
    """One finalizer tick: expire what is overdue, then finalize every batch whose job has ended."""
    expire_overdue(timezone.now())
    done = 0
    ended = Batch.objects.filter(finalized_at__isnull=True, job__status__in=TERMINAL).select_related("job")
    for batch in ended.order_by("pk")[:50]:
        done += finalize(batch)
    return done


def finalized(job: Job) -> bool:
    """Whether the job is a batch whose output files are written (it is final)."""
    return Batch.objects.filter(job=job, finalized_at__isnull=False).exists()
