"""The API's schema and its documentation pages (Swagger UI, Redoc): drf-spectacular's views, with their
OPTIONS answers and errors in the API's JSON.

drf-spectacular's pages render with DRF's TemplateHTMLRenderer only, so DRF rendered everything those
views answer through the page's template: OPTIONS (DRF's metadata) went into the Swagger template
without the variables it includes, hence TemplateDoesNotExist and a 500 with a traceback per request;
Redoc rendered an empty page for it, and a 401 or 405 came back as an HTML page on an /api/ path. The
schema view's renderers are the OpenAPI ones, so its errors came back as YAML. Only GET (and HEAD)
render the page or the schema now; every other answer is the API's JSON, as on every /api/ path.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request


class _JsonBesidesThePage:
    """OPTIONS (DRF's metadata) and errors are rendered as JSON; GET keeps the view's own renderer."""

    def finalize_response(self, request: Request, response: Any, *args: Any, **kwargs: Any) -> Any:
        if request.method == "OPTIONS" or getattr(response, "exception", False):
            request.accepted_renderer, request.accepted_media_type = JSONRenderer(), "application/json"
        return super().finalize_response(request, response, *args, **kwargs)  # type: ignore[misc]


class SchemaView(_JsonBesidesThePage, SpectacularAPIView):
    """The OpenAPI schema (YAML, or JSON when asked)."""


class SwaggerView(_JsonBesidesThePage, SpectacularSwaggerView):
    """Swagger UI over the schema."""


class RedocView(_JsonBesidesThePage, SpectacularRedocView):
    """Redoc over the schema."""
