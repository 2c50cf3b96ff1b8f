from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Offline jobs"

    def ready(self) -> None:
        from jobs import callbacks, monitoring, scheduler
        from jobs.signals import batch_finalized, job_ended
        from observability import registry

        job_ended.connect(callbacks.schedule, dispatch_uid="jobs.callbacks")
        batch_finalized.connect(callbacks.schedule, dispatch_uid="jobs.callbacks.batch")
        job_ended.connect(scheduler.on_job_ended, dispatch_uid="jobs.scheduler")
        registry.register_gauges(monitoring.gauges)
        registry.register_rule(monitoring.offline_stalled)
        registry.register_dashboard(monitoring.dashboard_section)
        registry.register_dashboard_filter(monitoring.dashboard_for)
        registry.register_metric_families(monitoring.metric_families)
