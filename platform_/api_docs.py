"""The API's schema and its documentation pages (Swagger UI, Redoc): drf-spectacular's views, with their
OPTIONS answers and errors in the API's JSON, the operations in sections with online inference first,
and pages of our own around the two UIs (a way back to the product, `lang`, no font from a CDN).

drf-spectacular's pages render with DRF's TemplateHTMLRenderer only, so DRF rendered everything those
views answer through the page's template: OPTIONS (DRF's metadata) went into the Swagger template
without the variables it includes, hence TemplateDoesNotExist and a 500 with a traceback per request;
Redoc rendered an empty page for it, and a 401 or 405 came back as an HTML page on an /api/ path. The
schema view's renderers are the OpenAPI ones, so its errors came back as YAML. Only GET (and HEAD)
render the page or the schema now; every other answer is the API's JSON, as on every /api/ path.
"""

from __future__ import annotations

import re
from typing import Any

from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request

# The API's sections, in the order the docs list them. drf-spectacular tagged every operation "api" (the
# first segment of /api/v1/...) and the predict operation, which a hook adds after the others
# (inference/web/api/schema.py), "models": Swagger UI listed predict last, under a section of its own after
# every other endpoint, although it is what most callers come for. Swagger UI and Redoc list sections in
# the order of the schema's `tags`, and operations within one in the order of `paths`.
SECTIONS: list[dict[str, str]] = [
    {
        "name": "predict",
        "description": "Online inference: run inputs through a model and get the answer within the request's "
        "deadline (POST .../predict), and the models there are with the inputs each takes (GET /models).",
    },
    {
        "name": "jobs",
        "description": "Offline jobs: upload a CSV or JSON lines file, follow the job, download its results.",
    },
    {
        "name": "account",
        "description": "Your API token, your API keys, what you used, and the secret that signs job callbacks.",
    },
    {"name": "health", "description": "Liveness and readiness probes (no token needed)."},
]
# The section of each first path segment after /api/v1/; a segment not named here is its own section,
# listed after these.
_SECTION_OF_SEGMENT = {
    "models": "predict",
    "jobs": "jobs",
    "token": "account",
    "callback-secret": "account",
    "keys": "account",
    "usage": "account",
    "health": "health",
    "ready": "health",
}
_FIRST_SEGMENT = re.compile(r"^/api/v\d+/([^/]+)")


def _section(path: str) -> str | None:
    match = _FIRST_SEGMENT.match(path)
    return _SECTION_OF_SEGMENT.get(match.group(1), match.group(1)) if match else None


def order_sections(
    result: dict[str, Any], generator: Any = None, request: Any = None, public: bool = True
) -> dict[str, Any]:
    """Tag each /api/vN/ operation with its section and order sections and paths: predict first.

    A drf-spectacular postprocessing hook's signature, so that it could run for every schema generated;
    listed in SPECTACULAR_SETTINGS["POSTPROCESSING_HOOKS"] (idempotent).
    """
    paths: dict[str, Any] = result.get("paths", {})
    for path, operations in paths.items():
        section = _section(path)
        if section is None:
            continue
        for operation in operations.values():
            if isinstance(operation, dict):
                operation["tags"] = [section]
    named = [s["name"] for s in SECTIONS]
    used = {_section(path) for path in paths} - {None}
    result["tags"] = [s for s in SECTIONS if s["name"] in used] + [{"name": n} for n in sorted(used - set(named))]
    rank = {tag["name"]: i for i, tag in enumerate(result["tags"])}

    def key(item: tuple[int, str]) -> tuple[int, int, int]:
        index, path = item
        # Within a section, the predict operation before the model list that tells what to predict with;
        # a path outside /api/vN/ last.
        return (rank.get(_section(path) or "", len(rank)), 0 if path.endswith("/predict") else 1, index)

    result["paths"] = {path: paths[path] for _, path in sorted(enumerate(paths), key=key)}
    return result


class _JsonBesidesThePage:
    """OPTIONS (DRF's metadata) and errors are rendered as JSON; GET keeps the view's own renderer."""

    def finalize_response(self, request: Request, response: Any, *args: Any, **kwargs: Any) -> Any:
        if request.method == "OPTIONS" or getattr(response, "exception", False):
            request.accepted_renderer, request.accepted_media_type = JSONRenderer(), "application/json"
        return super().finalize_response(request, response, *args, **kwargs)  # type: ignore[misc]


class SchemaView(_JsonBesidesThePage, SpectacularAPIView):
    """The OpenAPI schema (YAML, or JSON when asked), in the docs' sections (order_sections, a hook in
    SPECTACULAR_SETTINGS, so `manage.py spectacular` gives the same order)."""


class SwaggerView(_JsonBesidesThePage, SpectacularSwaggerView):
    """Swagger UI over the schema, under the docs' own header (templates/api_docs/)."""

    template_name = "api_docs/swagger_ui.html"


class RedocView(_JsonBesidesThePage, SpectacularRedocView):
    """Redoc over the schema, under the docs' own header (templates/api_docs/)."""

    template_name = "api_docs/redoc.html"
