from django.apps import AppConfig


class ObservabilityConfig(AppConfig):
    name = "observability"
    verbose_name = "Observability"

    def ready(self) -> None:
        from observability import registry, rules

        # The host's own rule: it reads only the host gauges this app samples.
        registry.register_rule(rules.host_saturated)
