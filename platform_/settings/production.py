"""Production profile: DJANGO_SETTINGS_MODULE=platform_.settings.production (docker-compose.yml and
deploy/kubernetes use it).

Everything in platform_/settings/base.py, plus the transport security that `manage.py check --deploy`
asks for, on by default. Each has its own switch for deployments where a TLS proxy in front already
does the job; a switch turned off also silences the check that would warn about it, so the check
stays clean and still speaks for whatever was not turned off on purpose.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

# The overlay idiom of Django settings (cookiecutter-django's `from .base import *`): this module
# is the base module's names with a few changed.
from platform_.settings.base import *  # noqa: F403
from platform_.settings.base import env

if not env.str("DJANGO_SECRET_KEY", default=""):
    # A key made up per process would differ between containers and processes and vanish with them.
    raise ImproperlyConfigured(
        "DJANGO_SECRET_KEY must be set in production, e.g. to the output of "
        "python -c 'import secrets; print(secrets.token_urlsafe(50))'"
    )

DEBUG = False
SILENCED_SYSTEM_CHECKS: list[str] = []

# DJANGO_BEHIND_TLS_PROXY: requests that reached the TLS proxy in front over HTTPS count as secure. The
# web server (platform_/server.py) takes X-Forwarded-Proto into the request's scheme only from the
# proxies in FORWARDED_ALLOW_IPS; Django's SECURE_PROXY_SSL_HEADER would believe the header from any
# client that reaches a web process directly, so it is not used. Without a proxy named every request
# would look like plain HTTP and the HTTPS redirect would loop: refuse to start instead.
if env.bool("DJANGO_BEHIND_TLS_PROXY", default=False) and not FORWARDED_ALLOW_IPS.strip():  # noqa: F405
    raise ImproperlyConfigured(
        "DJANGO_BEHIND_TLS_PROXY=true needs FORWARDED_ALLOW_IPS: the TLS proxy's address or network, whose "
        "X-Forwarded-Proto and X-Forwarded-For the web server may believe"
    )

# DJANGO_SECURE_SSL_REDIRECT: redirect plain HTTP to HTTPS; off when the proxy already redirects.
SECURE_SSL_REDIRECT = env.bool("DJANGO_SECURE_SSL_REDIRECT", default=True)
if not SECURE_SSL_REDIRECT:
    SILENCED_SYSTEM_CHECKS.append("security.W008")
# Liveness and readiness probes and Prometheus's scrapes come over plain HTTP from inside the network:
# never redirect them (a scrape redirected to HTTPS on the pod's address fails).
SECURE_REDIRECT_EXEMPT = [r"^api/v1/(ready|health)$", r"^metrics$"]

# DJANGO_SECURE_HSTS_SECONDS: how long browsers must use HTTPS only (0: no HSTS header, e.g. when the
# proxy sends it). Start small (3600) on a new domain; a year once HTTPS is known to work.
SECURE_HSTS_SECONDS = env.int("DJANGO_SECURE_HSTS_SECONDS", default=31_536_000)
# DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS: HSTS covers subdomains too.
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", default=True)
# DJANGO_SECURE_HSTS_PRELOAD: allow submitting the domain to browsers' preload lists.
SECURE_HSTS_PRELOAD = env.bool("DJANGO_SECURE_HSTS_PRELOAD", default=True)
if not SECURE_HSTS_SECONDS:
    SILENCED_SYSTEM_CHECKS.append("security.W004")
else:
    if not SECURE_HSTS_INCLUDE_SUBDOMAINS:
        SILENCED_SYSTEM_CHECKS.append("security.W005")
    if not SECURE_HSTS_PRELOAD:
        SILENCED_SYSTEM_CHECKS.append("security.W021")

# DJANGO_SECURE_COOKIES: session and CSRF cookies only over HTTPS (off only for a plain-HTTP trial).
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = env.bool("DJANGO_SECURE_COOKIES", default=True)
if not SESSION_COOKIE_SECURE:
    SILENCED_SYSTEM_CHECKS += ["security.W012", "security.W016"]
