"""Staff API over model versions: promote (and roll back), canary, and the deployment's state (issue 21).

Thin: every change is inference/deployments.py's, the same functions the admin actions and
`manage.py models` call. A promote answers 202: children load the version, and the switch happens when
every live child has it (GET the deployment, or /api/v1/models, to watch it).
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.scopes import KeyScopes
from inference import deployments
from platform_.errors import ApiError

_state = inline_serializer(
    "Deployment",
    fields={
        "model": serializers.CharField(),
        "active": serializers.CharField(),
        "target": serializers.CharField(allow_null=True, help_text="promoted, loading; switched to when loaded"),
        "previous": serializers.CharField(allow_null=True, help_text="what a rollback promotes"),
        "canary": serializers.CharField(allow_null=True),
        "canary_percent": serializers.FloatField(),
        "canary_ready": serializers.BooleanField(help_text="every live child has the canary loaded"),
        "changed_at": serializers.CharField(),
        "changed_by": serializers.CharField(),
    },
)


# What every staff endpoint here may refuse, documented so clients (and the schema fuzz test) expect it.
_REFUSALS = {
    403: OpenApiResponse(description="not staff, or an API key (model control needs a session or a DRF token)"),
    404: OpenApiResponse(description="unknown model or version (`unknown_model`, `unknown_version`)"),
}
_CHANGE_REFUSALS = {
    **_REFUSALS,
    409: OpenApiResponse(description="the change cannot be made now, e.g. a canary of the active version"),
}


class PromoteSerializer(serializers.Serializer):
    version = serializers.CharField(max_length=32)


class CanarySerializer(serializers.Serializer):
    version = serializers.CharField(max_length=32)
    percent = serializers.FloatField(min_value=0.01, max_value=100)


def _who(request: Request) -> str:
    return request.user.get_username()


def _answer(call, status: int = 200) -> Response:
    try:
        state = call()
    except deployments.DeploymentError as error:
        raise ApiError(error.status, error.code, str(error)) from None
    return Response(deployments.state_body(state), status=status)


@extend_schema(
    responses={200: _state, **_REFUSALS},
    summary="A model's deployment: active, target, previous and canary versions (staff)",
)
@api_view(["GET", "HEAD"])  # HEAD: monitors probe with it, as on every GET path
@permission_classes([IsAdminUser, KeyScopes])  # KeyScopes: no API key may (accounts/scopes.py)
def deployment(request: Request, name: str) -> Response:
    return _answer(lambda: deployments.current(name))


@extend_schema(
    request=PromoteSerializer,
    responses={202: _state, **_CHANGE_REFUSALS},
    summary="Promote a version (staff): load it beside the active one, then switch; promoting `previous` rolls back",
)
@api_view(["POST"])
@permission_classes([IsAdminUser, KeyScopes])  # KeyScopes: no API key may (accounts/scopes.py)
def promote(request: Request, name: str) -> Response:
    data = PromoteSerializer(data=request.data)
    data.is_valid(raise_exception=True)
    return _answer(lambda: deployments.promote(name, data.validated_data["version"], _who(request)), status=202)


@extend_schema(
    methods=["POST"],
    request=CanarySerializer,
    responses={202: _state, **_CHANGE_REFUSALS},
    summary="Give a version a sticky share of the model's callers (staff)",
)
@extend_schema(methods=["DELETE"], responses={200: _state, **_REFUSALS}, summary="End the model's canary (staff)")
@api_view(["POST", "DELETE"])
@permission_classes([IsAdminUser, KeyScopes])  # KeyScopes: no API key may (accounts/scopes.py)
def canary(request: Request, name: str) -> Response:
    if request.method == "DELETE":
        return _answer(lambda: deployments.clear_canary(name, _who(request)))
    data = CanarySerializer(data=request.data)
    data.is_valid(raise_exception=True)
    values = data.validated_data
    return _answer(lambda: deployments.set_canary(name, values["version"], values["percent"], _who(request)), 202)
