"""The caller's own API token: replace it (rotation).

A password change does not touch the API token (a token is a separate credential, as an API key is at
OpenAI or GitHub, and changing a password must not break every client at once); a user who fears the
token was seen replaces it here. The old key stops working at once on the DRF paths and within
AUTH_REVOCATION_CHECK_S on the cached predict path (inference/web/api/auth.py).
"""

from __future__ import annotations

from django.db import transaction
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import exceptions, serializers
from rest_framework.authtoken.models import Token
from rest_framework.decorators import api_view, throttle_classes
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import UserRateThrottle

from platform_.db import lock_user


class RotateThrottle(UserRateThrottle):
    rate = "10/hour"


class TokenReplaced(exceptions.APIException):
    status_code = 409
    default_code = "token_replaced"
    default_detail = "this token was replaced by another rotation meanwhile; use the key that rotation returned"


def rotate(user, presented: str | None = None) -> Token:
    """Delete the user's token (if any) and give them a new one. Concurrent rotations of one user queue
    on the user's row; one authenticated with a key that a rotation before it replaced is refused, so
    two callers never each believe they hold the current key."""
    with transaction.atomic():
        lock_user(user)
        current = Token.objects.filter(user=user).first()
        if presented is not None and (current is None or current.key != presented):
            raise TokenReplaced()
        if current is not None:
            current.delete()
        return Token.objects.create(user=user)


@extend_schema(
    request=None,
    responses=inline_serializer("RotatedToken", fields={"token": serializers.CharField()}),
    summary="Replace the caller's API token; the old one stops working",
)
@api_view(["POST"])
@throttle_classes([RotateThrottle])
def rotate_token(request: Request) -> Response:
    presented = request.auth.key if isinstance(request.auth, Token) else None  # None: a session caller
    return Response({"token": rotate(request.user, presented).key}, status=201)
