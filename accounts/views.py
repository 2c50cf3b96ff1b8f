"""The keys and usage pages for people: thin views over accounts.models and accounts.usage."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_http_methods, require_POST
from rest_framework.exceptions import ValidationError

from accounts import usage
from accounts.api.usage import date_range
from accounts.forms import NewKeyForm
from accounts.models import ApiKey, TooManyKeys


@login_required
@require_http_methods(["GET", "HEAD", "POST"])
def keys_page(request: HttpRequest) -> HttpResponse:
    """The user's keys and a form to make one; a new key's secret is shown on this answer only."""
    form = NewKeyForm(request.POST or None)
    issued = None
    if request.method == "POST" and form.is_valid() and not _no_room(request, form):
        data = form.cleaned_data
        key, raw = ApiKey.issue(
            request.user,
            data["name"],
            data["scopes"],
            models_allowed=data["models_allowed"],
            expires_at=form.expires_at(),
        )
        issued = {"key": key, "secret": raw}
        form = NewKeyForm()
    keys = ApiKey.objects.filter(user=request.user)
    return render(request, "accounts/keys.html", {"form": form, "keys": keys, "issued": issued})


def _no_room(request: HttpRequest, form: NewKeyForm) -> bool:
    try:
        ApiKey.check_room(request.user)
    except TooManyKeys as refused:
        form.add_error(None, str(refused.detail))
        return True
    return False


@login_required
@require_POST
def revoke_key(request: HttpRequest, pk: int) -> HttpResponse:
    key = get_object_or_404(ApiKey, pk=pk, user=request.user)  # another user's key: 404, as if absent
    key.revoke()
    messages.success(request, f"Key “{key.name}” ({key.prefix}…) is revoked: it is refused within seconds.")
    return redirect("accounts:keys")


@login_required
@require_http_methods(["GET", "HEAD"])
def usage_page(request: HttpRequest) -> HttpResponse:
    """The user's usage per day, model and key; the period from ?start=&end= (default: 30 days)."""
    error = ""
    try:
        first, last = date_range(
            request.GET.get("start"), request.GET.get("end"), usage._today(), settings.USAGE_MAX_DAYS
        )
    except ValidationError as exc:
        error = "; ".join(str(m) for messages_ in exc.detail.values() for m in messages_)
        first, last = date_range(None, None, usage._today(), settings.USAGE_MAX_DAYS)
    context = {
        "usage": usage.summary(request.user, first, last),
        "error": error,
        "flush_s": int(settings.USAGE_FLUSH_S),
    }
    return render(request, "accounts/usage.html", context, status=400 if error else 200)
