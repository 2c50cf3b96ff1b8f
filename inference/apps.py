from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "inference"
    verbose_name = "Inference"

    def ready(self) -> None:
        from inference import diagnosis, monitoring
        from observability import registry

        registry.register_gauges(monitoring.gauges)
        registry.register_snapshot_source(diagnosis.snapshot_source)
        registry.register_rule(*diagnosis.RULES)
        registry.register_dashboard(monitoring.dashboard_section)
        registry.register_housekeeping(monitoring.trim_slow_log, interval_s=60)
