"""WSGI entry point, for tools that want one; the served tier is ASGI (see asgi.py and the README)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings.local")
application = get_wsgi_application()
