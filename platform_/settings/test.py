"""Test profile: what pytest runs under (pyproject.toml), and the live stack's web and worker processes
that the test session starts (they inherit DJANGO_SETTINGS_MODULE).

The base settings, with fixed test secrets (the test process and its subprocesses must agree on them,
and nothing is generated), a fast password hasher, and a file for the SQLite test database (the live
stack's processes share it, so it cannot be in memory; tests/conftest.py creates its directory).
"""

from __future__ import annotations

from platform_.settings.base import *  # noqa: F403
from platform_.settings.base import DATABASES, VAR_DIR, env

SECRET_KEY = env.str("DJANGO_SECRET_KEY", default="test-secret-key-not-for-any-deployment-0123456789abcdef")
# The test process reads it to call /metrics as Prometheus would; the web process it starts reads the same.
METRICS_TOKEN = env.str("METRICS_TOKEN", default="test-metrics-token")

# Hashing with PBKDF2's production cost takes ~0.3 s per password set or checked; tests check many.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Tests share the database with live server and worker subprocesses, so it must be a file.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test_db.sqlite3")}
