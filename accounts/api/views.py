"""`/api/v1/keys`: a user lists, makes and revokes their own API keys (staff do it in the admin)."""

from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.api.serializers import ApiKeyCreateSerializer, ApiKeySerializer, IssuedKeySerializer
from accounts.models import ApiKey


class ApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """The caller's keys; DELETE revokes one (it stays listed as revoked, with its usage)."""

    serializer_class = ApiKeySerializer
    # For the schema generator only (it types the path's id from the model); requests use get_queryset().
    queryset = ApiKey.objects.none()

    def get_queryset(self) -> QuerySet[ApiKey]:
        return ApiKey.objects.filter(user=self.request.user)

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: IssuedKeySerializer}, summary="Make an API key")
    def create(self, request: Request) -> Response:
        given = ApiKeyCreateSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        ApiKey.check_room(request.user)
        key, raw = ApiKey.issue(request.user, **given.validated_data)
        key.key = raw
        return Response(IssuedKeySerializer(key).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: ApiKeySerializer}, summary="Revoke an API key: refused everywhere within seconds")
    def destroy(self, request: Request, pk: str | None = None) -> Response:
        key = self.get_object()
        key.revoke()
        return Response(ApiKeySerializer(key).data)
