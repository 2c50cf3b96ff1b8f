"""Local profile (`make run`, development): the default of manage.py, the Celery app, ASGI and WSGI.

The base settings as they are, plus where a local run's secrets come from when the environment does not
give them: scripts/run.py generates var/secret_key and var/metrics_token once per checkout and passes
them in the environment; a command started by hand (`manage.py shell`, a worker in another terminal)
reads the same files. Reading is all this does: no file is written and no directory created here.
"""

from __future__ import annotations

import secrets

# The overlay idiom of Django settings (cookiecutter-django's `from .base import *`): this module is the
# base module's names with a few changed.
from platform_.settings.base import *  # noqa: F403
from platform_.settings.base import METRICS_TOKEN, SECRET_KEY, VAR_DIR, env


def _var_secret(name: str) -> str:
    """The secret scripts/run.py generated into var/<name>, or "" when there is none."""
    try:
        return (VAR_DIR / name).read_text().strip()
    except OSError:
        return ""


# DJANGO_SECRET_KEY, else var/secret_key, else a key of this process alone (sessions and CSRF tokens
# then do not survive a restart nor cross processes: run `make run` once, or set DJANGO_SECRET_KEY).
SECRET_KEY = SECRET_KEY or _var_secret("secret_key") or secrets.token_urlsafe(50)
# METRICS_TOKEN, else var/metrics_token, else the base's token that nobody knows (staff sessions only).
METRICS_TOKEN = env.str("METRICS_TOKEN", default="") or _var_secret("metrics_token") or METRICS_TOKEN
