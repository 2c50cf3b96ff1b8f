"""`GET /api/v1/usage`: the caller's own usage per day, model and key (accounts/usage.py)."""

from __future__ import annotations

from datetime import date, timedelta

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import exceptions, serializers
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from accounts import usage

_counts = {metric: serializers.IntegerField() for metric in usage.METRICS}
_usage = inline_serializer(
    "Usage",
    fields={
        "start": serializers.DateField(),
        "end": serializers.DateField(),
        "totals": inline_serializer("UsageTotals", fields=_counts),
        "rows": serializers.ListField(
            child=inline_serializer(
                "UsageRow",
                fields={
                    "day": serializers.DateField(),
                    "model": serializers.CharField(),
                    "key_id": serializers.IntegerField(allow_null=True),
                    "key_name": serializers.CharField(allow_null=True),
                    "key_prefix": serializers.CharField(allow_null=True),
                    **_counts,
                },
            )
        ),
    },
)


def date_range(start: str | None, end: str | None, today: date, max_days: int) -> tuple[date, date]:
    """The period asked for (ISO dates, both inclusive; default: the last 30 days); 400 when malformed."""
    try:
        last = date.fromisoformat(end) if end else today
        first = date.fromisoformat(start) if start else last - timedelta(days=29)
    except ValueError:
        raise exceptions.ValidationError({"start": ["start and end are dates: YYYY-MM-DD"]}) from None
    if first > last:
        raise exceptions.ValidationError({"start": ["start is after end"]})
    if (last - first).days >= max_days:
        raise exceptions.ValidationError({"start": [f"at most {max_days} days at once"]})
    return first, last


@extend_schema(
    parameters=[
        OpenApiParameter("start", str, description="first day, YYYY-MM-DD (UTC); default: 29 days before end"),
        OpenApiParameter("end", str, description="last day, YYYY-MM-DD (UTC); default: today"),
    ],
    responses=_usage,
    summary="The caller's usage per day, model and key (updated every USAGE_FLUSH_S)",
)
@api_view(["GET", "HEAD"])  # HEAD as every GET endpoint answers it (monitors probe with it)
def usage_view(request: Request) -> Response:
    first, last = date_range(
        request.query_params.get("start"), request.query_params.get("end"), usage._today(), settings.USAGE_MAX_DAYS
    )
    return Response(usage.summary(request.user, first, last))
