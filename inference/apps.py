from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "inference"
    verbose_name = "Inference"

    def ready(self) -> None:
        from django.contrib.auth import get_user_model
        from django.db.models.signals import post_delete, post_save
        from rest_framework.authtoken.models import Token

        from inference import deployments
        from inference.web import diagnosis, monitoring
        from inference.web.api import auth
        from observability import registry

        # Cached tokens (inference/web/api/auth.py) are forgotten when one stops being valid.
        post_delete.connect(auth.revoked, sender=Token, dispatch_uid="auth-token-deleted")
        post_delete.connect(auth.revoked, sender=get_user_model(), dispatch_uid="auth-user-deleted")
        post_save.connect(auth.user_deactivated, sender=get_user_model(), dispatch_uid="auth-user-deactivated")

        registry.register_gauges(monitoring.gauges)
        registry.register_snapshot_source(diagnosis.snapshot_source)
        registry.register_rule(*diagnosis.RULES)
        registry.register_dashboard(monitoring.dashboard_section)
        registry.register_version_roles(monitoring.version_roles)
        registry.register_housekeeping(monitoring.trim_slow_log, interval_s=60)
        # Switch promoted versions once loaded everywhere, re-mirror deployments Redis lost (issue 21).
        registry.register_housekeeping(deployments.housekeeping, interval_s=0.5)
        registry.register_housekeeping(deployments.persist_digests, interval_s=10)
