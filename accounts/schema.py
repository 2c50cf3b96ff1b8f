"""How the OpenAPI schema describes API keys (drf-spectacular finds the class by its target)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = "accounts.authentication.ApiKeyAuthentication"
    name = "apiKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key (`ipk_...`, made at /keys/ or POST /api/v1/keys), as "
            "`Authorization: Bearer <key>` or `Token <key>`; it may do what its scopes allow.",
        }
