"""Rows that failed because of their input are marked, so that a retry leaves them (issue 24); the partial
status's label keeps the API's word."""

from django.db import migrations, models

# What the runner writes on a row that failed at run time (jobs/runner.py, ResultWriter.fail_the_rest): every
# other failed row failed a check of its input, at ingest or when a retried row was checked again.
RUN_TIME_FAILURE = "inference failed"


def mark_input_errors(apps, schema_editor):
    JobRow = apps.get_model("jobs", "JobRow")
    JobRow.objects.filter(status="failed").exclude(error__startswith=RUN_TIME_FAILURE).update(input_error=True)


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0007_retry_timing"),
    ]

    operations = [
        migrations.AddField(
            model_name="jobrow",
            name="input_error",
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.RunPython(mark_input_errors, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="job",
            name="status",
            field=models.CharField(
                choices=[
                    ("pending", "Pending"),
                    ("ingesting", "Ingesting"),
                    ("queued", "Queued"),
                    ("running", "Running"),
                    ("succeeded", "Succeeded"),
                    ("partial", "Partial (some rows failed)"),
                    ("failed", "Failed"),
                    ("cancelled", "Cancelled"),
                    ("expired", "Expired"),
                ],
                db_index=True,
                default="pending",
                max_length=16,
            ),
        ),
    ]
