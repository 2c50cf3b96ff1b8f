"""The calling user's callback secret: created or rotated by POST (its only showing), described by GET.

The secret signs the user's job callbacks (jobs/callbacks.py). It is kept in the clear because
signing needs it, but it leaves the server once, in the POST's answer: GET says only whether one
exists and since when, so a leaked session or token cannot read it back, only replace it.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs.callbacks import rotate_secret
from jobs.models import CallbackSecret

_described = inline_serializer(
    "CallbackSecretState",
    {"exists": serializers.BooleanField(), "created_at": serializers.DateTimeField(allow_null=True)},
)
_created = inline_serializer(
    "CallbackSecretCreated",
    {"secret": serializers.CharField(), "created_at": serializers.DateTimeField()},
)


class CallbackSecretView(APIView):
    """GET: whether you have a callback secret, and when it was made. POST: a new one, shown once."""

    @extend_schema(
        summary="Whether you have a callback secret",
        description="Whether you have a secret for signing job callbacks, and when it was made; never its value.",
        responses={200: _described},
    )
    def get(self, request: Request) -> Response:
        secret = CallbackSecret.objects.filter(owner=request.user).only("created_at").first()
        return Response({"exists": secret is not None, "created_at": secret.created_at if secret else None})

    @extend_schema(
        summary="Create or rotate your callback secret",
        description="A new secret for signing your job callbacks (X-Signature-256), replacing any earlier one at"
        " once. The answer is the only time the secret is shown.",
        request=None,
        responses={201: _created},
    )
    def post(self, request: Request) -> Response:
        # Rotation replaces the secret at once: callbacks sent from now on are signed with the new one.
        secret = rotate_secret(request.user)
        return Response({"secret": secret.secret, "created_at": secret.created_at}, status=status.HTTP_201_CREATED)
