"""Shapes of jobs and rows on the API."""

from __future__ import annotations

from django.conf import settings
from rest_framework import serializers
from rest_framework.reverse import reverse

from inference.core.registry import get_registry
from jobs.callbacks import CallbackRefused, check_destination
from jobs.ingest import column_fields, default_column, shown
from jobs.models import CallbackSecret, FileFormat, Job, JobRow, Priority
from jobs.scheduler import Standing, standing_of


class JobSerializer(serializers.ModelSerializer):
    """A job with its progress, rate and ETA (and, while `ingesting`, how much of the file is read)."""

    owner = serializers.CharField(source="owner.username", read_only=True)
    progress = serializers.FloatField(read_only=True)
    ingest_progress = serializers.FloatField(
        read_only=True, help_text="fraction of the upload read into rows; 1.0 once the job is past `ingesting`"
    )
    eta_s = serializers.SerializerMethodField(
        help_text="seconds until the job ends, from the offline workers' measured rate and the job's place in the "
        "fair share (the work handed out before its last rows); null when unknown"
    )
    chunks_ahead = serializers.SerializerMethodField(
        help_text="other jobs' chunks to be run before this job's next one under the current shares; null when "
        "the job is not waiting or its place is too far to compute"
    )
    rows_ahead = serializers.SerializerMethodField(
        help_text="other jobs' rows to be run before this job's last chunk; null when unknown"
    )
    waiting_reason = serializers.SerializerMethodField(
        help_text='why the job does not have every offline worker, e.g. "waiting: 3 jobs of higher priority"; '
        "empty when nothing else competes"
    )
    elapsed_s = serializers.SerializerMethodField(
        help_text="seconds the job has run: from its start to its end (or now), less the time it spent ended "
        "before a retry; null until it starts. `rows_per_s` is its done rows over this time"
    )
    links = serializers.SerializerMethodField()
    batch_id = serializers.SerializerMethodField(
        help_text="the OpenAI batch (`batch_...`) this job runs, for jobs created by POST /v1/batches; else null"
    )
    callback_url = serializers.CharField(
        read_only=True, help_text="where the job's summary is POSTed when it ends; empty: none"
    )
    callback_status = serializers.CharField(
        read_only=True,
        help_text="pending, delivered or failed; empty when the job has no callback_url or has not ended",
    )

    class Meta:
        model = Job
        fields = [
            "id", "batch_id", "owner", "model", "model_version", "priority", "status", "filename", "file_format", "text_column", "input_columns", "id_column", "encoding",
            "delimiter",
            "upload_bytes", "ingested_rows", "ingest_progress",
            "total_rows", "done_rows", "failed_rows", "progress", "elapsed_s", "rows_per_s", "eta_s",
            "chunks_ahead", "rows_ahead", "waiting_reason",
            "created_at", "started_at", "finished_at", "error",
            "callback_url", "callback_status", "callback_attempts", "callback_last_status", "links",
        ]  # fmt: skip
        read_only_fields = fields

    def _standing(self, job: Job) -> Standing | None:
        # Four fields read it: computed once per job and answer (a sent job's costs a query).
        cache = self.__dict__.setdefault("_standings", {})
        if job.pk not in cache:
            cache[job.pk] = standing_of(job)
        return cache[job.pk]

    def get_elapsed_s(self, job: Job) -> float | None:
        elapsed_s = job.elapsed_s()
        return None if elapsed_s is None else round(elapsed_s, 1)

    def get_eta_s(self, job: Job) -> float | None:
        standing = self._standing(job)
        if standing is None:
            return 0.0 if job.is_terminal else None
        return None if standing.eta_s is None else round(standing.eta_s, 1)

    def get_chunks_ahead(self, job: Job) -> int | None:
        standing = self._standing(job)
        return standing.chunks_ahead if standing else None

    def get_rows_ahead(self, job: Job) -> int | None:
        standing = self._standing(job)
        return standing.rows_ahead if standing else None

    def get_waiting_reason(self, job: Job) -> str:
        standing = self._standing(job)
        return standing.waiting_reason if standing else ""

    def get_batch_id(self, job: Job) -> str | None:
        if job.file_format != FileFormat.BATCH:
            return None
        batch = getattr(job, "batch", None)  # selected with the job by visible_jobs
        return batch.public_id if batch else None

    def get_links(self, job: Job) -> dict[str, str]:
        request = self.context.get("request")
        return {
            "self": reverse("job-detail", args=[job.pk], request=request),
            "results": reverse("job-results", args=[job.pk], request=request),
            "results_csv": reverse("job-results-csv", args=[job.pk], request=request),
            "results_jsonl": reverse("job-results-jsonl", args=[job.pk], request=request),
        }


class JobCreateSerializer(serializers.Serializer):
    """The upload form: a CSV file and how to read it."""

    file = serializers.FileField()
    model = serializers.CharField(required=False, help_text="a served model name; default: the registry's default")
    # One `<field>_column` per input field of the model's task (inference/core/task_io.py); which are
    # needed, and that none is given that the task does not read, is checked by ingest.input_columns.
    text_column = serializers.CharField(
        required=False,
        allow_blank=True,
        default="",
        max_length=255,
        help_text="text tasks (router, classification, embedding, token-classification): the column to run; "
        "default: text. Refused for question-answering models",
    )
    question_column = serializers.CharField(
        required=False,
        allow_blank=True,
        default="",
        max_length=255,
        help_text="question-answering models: the column of questions (default: question)",
    )
    context_column = serializers.CharField(
        required=False,
        allow_blank=True,
        default="",
        max_length=255,
        help_text="question-answering models: the column of contexts, passages the answer is taken from "
        "(default: context)",
    )
    id_column = serializers.CharField(required=False, allow_blank=True, default="", max_length=255)
    encoding = serializers.CharField(
        default="utf-8",
        max_length=40,
        help_text="a character encoding, for example utf-8, latin-1, gbk; a UTF-8/16/32 byte-order mark is honoured",
    )
    delimiter = serializers.ChoiceField(
        choices=["comma", "semicolon", "tab"],
        required=False,
        help_text="CSV: default: detected from the header",
        error_messages={"invalid_choice": "must be comma, semicolon or tab"},  # DRF's own would echo the value
    )
    file_format = serializers.ChoiceField(
        choices=["csv", "jsonl"],
        required=False,
        help_text="csv (a header line, columns by name) or jsonl (one JSON object per line, fields by key: "
        "`text_column` names the key); default: jsonl for a .jsonl or .ndjson file name, else csv",
        error_messages={"invalid_choice": "must be csv or jsonl"},
    )

    priority = serializers.ChoiceField(
        choices=Priority.choices,
        default=Priority.NORMAL,
        help_text="high, normal or low: higher bands are served first, and a lower band keeps a small share; "
        "at most your highest allowed priority (normal unless staff raised it)",
        error_messages={"invalid_choice": "must be high, normal or low"},
    )
    callback_url = serializers.URLField(
        required=False,
        allow_blank=True,
        max_length=2000,
        help_text="POSTed the job's summary when it ends, signed with your callback secret (X-Signature-256)",
    )

    def get_fields(self) -> dict[str, serializers.Field]:
        """The declared fields, plus a `<field>_column` for each input field of a plugin task the models
        file names (a rerank's query_column and documents_column)."""
        fields = super().get_fields()
        for name in column_fields():
            if name not in fields:
                fields[name] = serializers.CharField(
                    required=False,
                    allow_blank=True,
                    default="",
                    max_length=255,
                    help_text=f"models of a task with a {default_column(name)} input field: its column "
                    f"(default: {default_column(name)})",
                )
        return fields

    def validate_callback_url(self, value: str) -> str:
        if not value:
            return value
        try:
            check_destination(value, allow_private=settings.JOBS_CALLBACK_ALLOW_PRIVATE)
        except CallbackRefused as refused:
            raise serializers.ValidationError(str(refused)) from None
        request = self.context.get("request")
        # A callback signed with a secret its receiver never saw cannot be verified: the secret comes first.
        if request is not None and not CallbackSecret.objects.filter(owner=request.user).exists():
            raise serializers.ValidationError(
                "create your callback secret first (POST /api/v1/callback-secret; it is shown once), so that"
                " you can verify the callbacks' signatures"
            )
        return value

    def validate_model(self, value: str) -> str:
        """A served model, or `model@version` to pin the job to that version (issue 21)."""
        registry = get_registry()
        name, _, version = value.partition("@")
        if registry.get(name) is None:
            raise serializers.ValidationError(
                f"unknown model {shown(name)}; served models: {', '.join(registry.names())}"
            )
        if version and version not in registry.versions_of(name):
            raise serializers.ValidationError(
                f"model {name!r} has no version {shown(version)}; its versions: "
                f"{', '.join(sorted(registry.versions_of(name)))}"
            )
        request = self.context.get("request")
        if version and not (request is not None and request.user.is_staff):
            # A pinned job makes the shared offline worker load that version beside its others: a tenant
            # may pin only what the deployment serves or just replaced (staff may pin any version).
            from inference.deployments import current

            state = current(name)
            allowed = sorted({state.active, state.canary, state.previous} - {None, ""})
            if version not in allowed:
                raise serializers.ValidationError(
                    f"a job may pin version {shown(version)} of model {name!r} only while it is the active, "
                    f"canary or previous version; now: {', '.join(allowed)} (staff may pin any version)"
                )
        return value


class RowSerializer(serializers.ModelSerializer):
    """One row: its input (`text`; `inputs` for tasks with several input fields) and the model's `output`."""

    inputs = serializers.JSONField(
        read_only=True,
        allow_null=True,
        help_text='the structured input, e.g. {"question", "context"} for question-answering; null for text tasks',
    )
    output = serializers.JSONField(
        read_only=True,
        allow_null=True,
        help_text='the model\'s answer as the predict API gives it: {"label", "score", "scores"}, '
        '{"answer", "start", "end", "score"} (offsets into the context), {"entities", "truncated"}, ...',
    )

    row = serializers.IntegerField(
        source="row_number",
        read_only=True,
        help_text="the row's number from 1 (the file's first data row is row 1), as the job page, the admin and "
        "the exports number it; `index` is the same row from 0",
    )
    input_error = serializers.BooleanField(
        read_only=True,
        help_text="the row failed because of its input (empty, too long, a missing field): a retry leaves it; "
        "fix the file and upload it again",
    )

    class Meta:
        model = JobRow
        fields = [
            "row", "index", "external_id", "text", "inputs", "status", "label", "score", "output", "error", "input_error",
            "attempts", "low_confidence", "corrected_label", "model_version",
        ]  # fmt: skip
        read_only_fields = fields
