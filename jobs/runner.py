"""Running a batch of chunks (across jobs) in an offline worker child, and writing results in bulk.

celery-batches swallows exceptions and ignores time limits, so this code owns the outcome: every
claimed chunk ends `done` with each of its rows done or failed, and a crash before that leaves the
chunk `running` with a stale `progress_at`, which the reconciler re-enqueues.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from django.conf import settings

from accounts import usage
from inference.child import runtime
from inference.core.backlog import online_in_flight
from inference.core.planning import group_by
from inference.core.registry import ModelSpec, get_registry
from jobs import lifecycle, scheduler
from jobs.ingest import inputs_error, row_error
from jobs.keys import OFFLINE_YIELD_FIELD, offline_inference_field, offline_rows_field, offline_user_rows_field
from jobs.models import RUNNABLE, Chunk, Job, JobRow, RowStatus
from observability import metrics
from platform_.redis import get_redis

logger = logging.getLogger(__name__)
# Progress recounts the job's rows: often enough to watch, rarely enough to cost little on big jobs.
_PROGRESS_EVERY_S = 2.0
_ROW_FIELDS = ["status", "label", "score", "output", "error", "attempts", "low_confidence", "model_version"]


def claim(chunk_ids: list[int], stall_s: float) -> list[Chunk]:
    """Take the chunks no one else is working on: queued, or running but silent for stall_s (its worker died)."""
    return Chunk.objects.claim(chunk_ids, stall_s)


class _AllCancelled(Exception):
    """Stops a batch whose jobs were all cancelled while it ran: its remaining passes would be for nobody."""


class ResultWriter:
    """Writes each pass's results as it finishes, and keeps chunk and job progress current."""

    def __init__(self, model: str, rows: list[JobRow], chunks: list[Chunk], low_confidence: float) -> None:
        self.model, self.rows, self.chunks, self.low_confidence = model, rows, chunks, low_confidence
        self.version = ""  # the model version the rows run on: each written row records it
        self.job_ids = sorted({c.job_id for c in chunks})
        self.written: set[int] = set()
        self.cancelled: set[int] = set()
        self._last_progress = 0.0
        self._user_fields: dict[int, str] | None = None  # job id -> its owner's and priority's rows field
        self._owners: dict[int, tuple[int, int | None]] = {}  # job id -> (owner id, API key id): usage metering

    def pass_done(self, indices: list[int], outputs: list[Any], passes: list[Any]) -> None:
        updates = []
        for i in indices:
            row = self.rows[i]
            if row.job_id in self.cancelled:
                continue
            output = outputs[i]
            # label and score are the output's own top-level ones: a classifier's label and score; a
            # question-answering answer's score with no label (an answer is not one of a model's labels:
            # it would flood the label summary and the review's label choices); for token-classification
            # and embeddings neither (a row has no single confidence; each entity carries its score).
            score = output.get("score")
            score = float(score) if isinstance(score, int | float) else None
            row.status, row.output, row.error = RowStatus.DONE, output, ""
            row.model_version = self.version
            row.label = str(output.get("label", ""))[:100]
            row.score = score
            row.low_confidence = score is not None and score < self.low_confidence
            row.attempts += 1
            updates.append(row)
            self.written.add(i)
        # Written only if the job is still running: a cancel that committed first wins, and the
        # writer learns of it now rather than at the next progress check.
        self.cancelled |= JobRow.objects.complete(updates, _ROW_FIELDS)
        written = sum(1 for row in updates if row.job_id not in self.cancelled)
        done = passes[indices[0]]
        fields = {offline_rows_field(self.model): written, offline_inference_field(self.model): done.end - done.start}
        rows_by_owner: dict[tuple[int, int | None], int] = {}
        for row in updates:
            field = None if row.job_id in self.cancelled else self._user_field(row.job_id)
            if field is not None:
                fields[field] = fields.get(field, 0) + 1
                owner = self._owners[row.job_id]
                rows_by_owner[owner] = rows_by_owner.get(owner, 0) + 1
        metrics.record(get_redis(), fields)
        usage.record_job_rows(get_redis(), rows_by_owner, self.model)  # each owner's metered job rows
        if time.monotonic() - self._last_progress >= _PROGRESS_EVERY_S:
            self.progress()

    def progress(self) -> None:
        self._last_progress = time.monotonic()
        Chunk.objects.touch([c.pk for c in self.chunks])
        for job in Job.objects.filter(pk__in=self.job_ids):
            if job.status not in RUNNABLE:
                self.cancelled.add(job.pk)
            else:
                job.refresh_counts()

    def _user_field(self, job_id: int) -> str | None:
        """The metric field counting rows per owner and priority (the dashboard's and /metrics' per-user
        figures): read once per batch; a priority changed by staff meanwhile counts from the next batch."""
        if self._user_fields is None:
            jobs = list(
                Job.objects.filter(pk__in=self.job_ids).values_list(
                    "pk", "owner__username", "priority", "owner_id", "api_key_id"
                )
            )
            self._user_fields = {pk: offline_user_rows_field(user, priority) for pk, user, priority, _, _ in jobs}
            self._owners = {pk: (owner_id, key_id) for pk, _, _, owner_id, key_id in jobs}
        return self._user_fields.get(job_id)  # None: the job was deleted meanwhile

    def all_cancelled(self) -> bool:
        """Whether every job in the batch was cancelled (as of the last write or progress check)."""
        return self.cancelled.issuperset(self.job_ids)

    def fail_the_rest(self, error: str) -> None:
        failed = [row for i, row in enumerate(self.rows) if i not in self.written]
        for row in failed:
            row.status, row.error, row.attempts = RowStatus.FAILED, error[:500], row.attempts + 1
            row.input_error = False  # the run failed it, not its input: a retry may succeed
        self.cancelled |= JobRow.objects.fail(failed)


def yield_to_online(in_flight: Callable[[], int], max_wait_s: float, poll_s: float = 0.02) -> float:
    """Wait while online requests are in flight, at most `max_wait_s`; the seconds waited.

    A lower CPU priority is not isolation on a small machine: an offline pass running beside online
    ones still shares the cores' caches and memory bandwidth, and measured on 2 cores it tripled
    online P99 at half load. So offline passes start in the gaps of online traffic, and the cap keeps
    the job moving when online traffic never pauses.
    """
    started = time.monotonic()
    while time.monotonic() - started < max_wait_s and in_flight() > 0:
        time.sleep(poll_s)
    return time.monotonic() - started


_online_seen_at = 0.0


def _yield_to_online() -> int | None:
    """Wait for a gap in online traffic; the most texts the next pass may hold (None: as planned).

    Beside online traffic (seen within the last second) passes are cut to JOBS_PASS_TEXTS_BESIDE_ONLINE
    texts, so one that starts in a gap is over before many online requests arrive to share the cores.
    """
    global _online_seen_at
    if settings.JOBS_YIELD_MAX_MS <= 0:
        return None
    models = get_registry().names()

    def in_flight() -> int:
        global _online_seen_at
        count = online_in_flight(get_redis(), models)
        if count:
            _online_seen_at = time.monotonic()
        return count

    try:
        waited = yield_to_online(in_flight, settings.JOBS_YIELD_MAX_MS / 1000)
        if waited >= 0.001:
            metrics.record(get_redis(), {OFFLINE_YIELD_FIELD: waited})
    except redis.RedisError:  # yielding is a courtesy: a Redis blip must not fail the batch
        logger.warning("could not check online traffic; this pass does not wait for it", exc_info=True)
        return None
    return settings.JOBS_PASS_TEXTS_BESIDE_ONLINE if time.monotonic() - _online_seen_at < 1.0 else None


def run_chunks(requests: list[Any]) -> None:
    """Run the chunks these requests name; requests for several models run model by model."""
    for model, group in group_by(requests, lambda r: r.kwargs["model"]).items():
        _run_model(model, [r.kwargs["chunk_id"] for r in group])


def _model_error(spec: ModelSpec, inputs: dict[str, str]) -> str:
    """Why the model cannot take this row's structured input ("" when it can), as predict's 400 says it
    (its task type's `input_problem`: for question-answering a field with nothing its tokenizer reads, a
    question too long for its windows, or more tokens than one forward pass). Checked before the batch
    runs: the handler raising on one row would fail every row of the batch, other users' jobs included."""
    task_type = spec.task_type
    return task_type.input_problem(spec, task_type.input_from_cells(inputs))


def _run_model(model: str, chunk_ids: list[int]) -> None:
    chunks = claim(chunk_ids, settings.JOBS_STALL_S)
    # The claimed chunks left the broker: their places go to whatever the fair share picks next, which
    # waits while this batch runs (so the child never idles between batches).
    scheduler.refill_quietly()
    if not chunks:
        return
    Job.start(c.job_id for c in chunks)
    # Each job runs on the version it pinned (jobs/versions.py), so a batch mixing jobs pinned to
    # different versions runs as one batch per version.
    pinned = dict(Job.objects.filter(pk__in={c.job_id for c in chunks}).values_list("pk", "model_version"))
    for version, group in group_by(chunks, lambda c: pinned.get(c.job_id) or "").items():
        _run_version(model, version or None, group)


def _ensure_loaded(model: str, version: str) -> None:
    """Load a job's pinned version in this child if it lacks it (beside the others, at most two extra)."""
    from inference.child import versions

    if versions.keeper is not None:
        versions.keeper.ensure(model, version)
    elif (model, version) not in runtime._versions:  # a child without a keeper (tests): load it plainly
        spec = get_registry().version_spec(model, version)
        if spec is None:
            raise versions.VersionRefused(f"model {model!r} has no version {version!r} in the models file")
        versions.verify(spec, get_redis())
        runtime.load_one(spec)


def _run_version(model: str, version: str | None, chunks: list[Chunk]) -> None:
    """Run the chunks of jobs pinned to `version` of `model` (None: jobs from before versions, which run on
    this child's default version)."""
    rows = lifecycle.pending_rows(chunks)
    spec = get_registry().version_spec(model, version) or get_registry().get(model)
    # Tasks with several input fields (question-answering) run on the row's stored `inputs` (cells, as
    # the file gave them: the task type makes each an input); the others on its text. A retried row is
    # checked again, with the same messages as at ingest.
    task_type = spec.task_type if spec is not None else None
    fields = task_type.input_fields if task_type is not None and not task_type.takes_text else None
    invalid = []
    for row in rows:
        if fields:
            error = inputs_error(row.inputs, fields, settings.JOBS_MAX_TEXT_CHARS) or _model_error(spec, row.inputs)
        else:
            error = row_error(row.text, settings.JOBS_MAX_TEXT_CHARS)
        if error:
            # Its input fails it (as at ingest, e.g. too many tokens for the model): a retry would too.
            row.status, row.error, row.attempts, row.input_error = RowStatus.FAILED, error, row.attempts + 1, True
            invalid.append(row)
    JobRow.objects.fail(invalid)
    rows = [row for row in rows if row.status == RowStatus.PENDING]
    threshold = (
        spec.low_confidence_below if spec and spec.low_confidence_below is not None else settings.JOBS_LOW_CONFIDENCE
    )
    writer = ResultWriter(model, rows, chunks, threshold)
    writer.version = version or (spec.version if spec else "")

    def before_pass() -> int | None:
        if writer.all_cancelled():
            raise _AllCancelled
        return _yield_to_online()

    try:
        if rows:
            if version:
                _ensure_loaded(model, version)
            else:
                writer.version = runtime.spec(model).version
            inputs = [task_type.input_from_cells(row.inputs) if fields else row.text for row in rows]
            runtime.run(model, inputs, on_pass=writer.pass_done, before_pass=before_pass, version=version)
    except _AllCancelled:
        logger.info("every job in this offline batch was cancelled: its remaining passes are skipped")
    except Exception as exc:  # the batch's rows must end failed, not pending forever
        logger.exception("offline batch of %d rows on %s failed", len(rows), model)
        writer.fail_the_rest(f"inference failed: {exc}")
    Chunk.objects.complete([c.pk for c in chunks])
    writer.progress()
    for job in Job.objects.filter(pk__in=writer.job_ids):
        job.finish()


def requeue_lost(chunk_ids: list[int]) -> None:
    """A child died holding these chunks: make them claimable at once (their messages are requeued)."""
    Chunk.objects.requeue(chunk_ids, message_kept=True)
