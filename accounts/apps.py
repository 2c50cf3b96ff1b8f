from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "accounts"
    verbose_name = "Keys, usage and quotas"

    def ready(self) -> None:
        from django.conf import settings
        from django.db.models.signals import post_delete, post_save

        from accounts import lastused, schema, usage  # noqa: F401  (schema: registers the key scheme)
        from accounts.models import ApiKey, Quota
        from inference.web.api import auth
        from observability import registry

        # A key revoked, expired early, narrowed or deleted: every web process forgets its cached
        # credentials within AUTH_REVOCATION_CHECK_S (the same counter DRF tokens and users use).
        post_save.connect(auth.revoked, sender=ApiKey, dispatch_uid="accounts-key-saved")
        post_delete.connect(auth.revoked, sender=ApiKey, dispatch_uid="accounts-key-deleted")
        # Limits are cached with the credential: a changed override is seen as soon as a revocation is.
        post_save.connect(auth.revoked, sender=Quota, dispatch_uid="accounts-quota-saved")
        post_delete.connect(auth.revoked, sender=Quota, dispatch_uid="accounts-quota-deleted")
        registry.register_housekeeping(lastused.flush, interval_s=settings.API_KEY_LAST_USED_FLUSH_S)
        registry.register_housekeeping(usage.flush, interval_s=settings.USAGE_FLUSH_S)
        registry.register_metric_families(usage.metric_families)
