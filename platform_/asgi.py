"""ASGI entry point: the web tier runs under uvicorn so predict calls wait on Redis without a thread each."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings")
application = get_asgi_application()
