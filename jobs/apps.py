from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Offline jobs"

    def ready(self) -> None:
        from jobs import monitoring
        from observability import registry

        registry.register_gauges(monitoring.gauges)
        registry.register_rule(monitoring.offline_stalled)
        registry.register_dashboard(monitoring.dashboard_section)
