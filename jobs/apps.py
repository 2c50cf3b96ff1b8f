from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Offline jobs"

    def ready(self) -> None:
        from django.db.models.signals import pre_save

        from jobs import callbacks, monitoring, scheduler, versions
        from jobs.models import Job
        from jobs.signals import batch_finalized, job_ended
        from observability import registry

        job_ended.connect(callbacks.schedule, dispatch_uid="jobs.callbacks")
        batch_finalized.connect(callbacks.schedule, dispatch_uid="jobs.callbacks.batch")
        job_ended.connect(scheduler.on_job_ended, dispatch_uid="jobs.scheduler")
        # A new job pins its model's active version (issue 21): jobs/versions.py.
        pre_save.connect(versions.pin_on_create, sender=Job, dispatch_uid="jobs.pin_version")
        registry.register_gauges(monitoring.gauges)
        registry.register_rule(monitoring.offline_stalled)
        registry.register_dashboard(monitoring.dashboard_section)
        registry.register_dashboard_filter(monitoring.dashboard_for)
        registry.register_metric_families(monitoring.metric_families)
