"""Settings profiles, in cookiecutter-django's layout; DJANGO_SETTINGS_MODULE names one of them.

- `platform_.settings.base`: every setting, read from the environment (new settings go there);
- `platform_.settings.local`: `make run` and development, the default of manage.py, the Celery app,
  ASGI and WSGI;
- `platform_.settings.production`: transport security on, DJANGO_SECRET_KEY required;
- `platform_.settings.test`: what pytest runs under (pyproject.toml), fixed test secrets, a fast hasher.

Naming the package itself (DJANGO_SETTINGS_MODULE=platform_.settings, as scripts written before the
split do) still means the local profile: upper-case names are looked up in `local` on first use
(PEP 562), so importing another profile never imports `local`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


def _local() -> ModuleType:
    return importlib.import_module("platform_.settings.local")


def __getattr__(name: str) -> Any:
    if name.isupper():
        try:
            return getattr(_local(), name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {name for name in dir(_local()) if name.isupper()})
