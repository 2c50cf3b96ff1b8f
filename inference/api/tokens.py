"""The caller's own API token: replace it (rotation).

A password change does not touch the API token (a token is a separate credential, as an API key is at
OpenAI or GitHub, and changing a password must not break every client at once); a user who fears the
token was seen replaces it here. The old key stops working at once on the DRF paths and within
AUTH_REVOCATION_CHECK_S on the cached predict path (inference/api/auth.py).
"""

from __future__ import annotations

from django.db import transaction
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.authtoken.models import Token
from rest_framework.decorators import api_view, throttle_classes
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import UserRateThrottle


class RotateThrottle(UserRateThrottle):
    rate = "10/hour"


def rotate(user) -> Token:
    """Delete the user's token (if any) and give them a new one, in one transaction."""
    with transaction.atomic():
        Token.objects.filter(user=user).delete()
        return Token.objects.create(user=user)


@extend_schema(
    request=None,
    responses=inline_serializer("RotatedToken", fields={"token": serializers.CharField()}),
    summary="Replace the caller's API token; the old one stops working",
)
@api_view(["POST"])
@throttle_classes([RotateThrottle])
def rotate_token(request: Request) -> Response:
    return Response({"token": rotate(request.user).key}, status=201)
