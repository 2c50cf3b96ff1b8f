"""Project URLs: the API under /api/v1/, its schema and docs, the admin."""

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth import views as auth_views
from django.contrib.staticfiles.views import serve as serve_static
from django.urls import include, path, re_path
from django.views.generic import RedirectView

from platform_.api_docs import RedocView, SchemaView, SwaggerView
from platform_.auth_throttle import throttle_login


class LogoutView(auth_views.LogoutView):
    """Django's log out, and the login page it leads to says so (issue 24: nothing told people they were
    out). The message survives the session's end: the default message storage keeps it in a cookie."""

    def post(self, request, *args, **kwargs):
        response = super().post(request, *args, **kwargs)
        messages.success(request, "You are logged out.")
        return response


urlpatterns = [
    path("", RedirectView.as_view(url="/jobs/", permanent=False)),
    # One login page (templates/registration/login.html) for people and for the admin (which takes
    # staff only), with failed-authentication throttling (429 after repeated bad passwords from one
    # address); listed before the includes that also define them, so these win. Log out is a POST.
    path(
        "admin/login/",
        throttle_login(
            auth_views.LoginView.as_view(
                authentication_form=AdminAuthenticationForm,
                next_page="/admin/",
                extra_context={"admin_login": True, "hide_login_link": True},
            )
        ),
    ),
    path(
        "accounts/login/",
        throttle_login(auth_views.LoginView.as_view(extra_context={"hide_login_link": True})),
        name="login",
    ),
    path("accounts/logout/", LogoutView.as_view(next_page="/accounts/login/"), name="logout"),
    path("admin/logout/", LogoutView.as_view(next_page="/accounts/login/")),
    path("admin/", admin.site.urls),
    path("", include("observability.urls")),  # /dashboard/, /dashboard/data.json, /metrics
    path("api/v1/", include("inference.web.api.urls")),
    path("api/v1/", include("jobs.api.urls")),
    # OpenAI-compatible embeddings for OpenAI clients (base_url <host>/v1): inference/web/api/openai_compat.py.
    # The OpenAI Files and Batch APIs over offline jobs (jobs/api/openai_batches.py), before the catch-all.
    path("v1/", include("jobs.api.openai_batches")),
    path("v1/", include("inference.web.api.openai_compat")),
    path("jobs/", include("jobs.urls")),
    path("", include("accounts.urls")),  # /keys/ (and /usage/): each user's own API keys and consumption
    # Session login for people (browser pages, and API calls from a logged-in browser).
    path("accounts/", include("rest_framework.urls")),
    # drf-spectacular's views, with OPTIONS and errors answered as JSON (platform_/api_docs.py).
    path("api/schema/", SchemaView.as_view(), name="schema"),
    path("api/docs/", SwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/redoc/", RedocView.as_view(url_name="schema"), name="api-redoc"),
]

if settings.SERVE_STATIC:
    # The app serves its own static files (admin, API docs) from the installed apps: no CDN, no
    # collectstatic, no extra server for `make run`. Behind a proxy, collectstatic and turn this off.
    urlpatterns.append(re_path(r"^static/(?P<path>.*)$", serve_static, {"insecure": True}))

# Styled pages with navigation for people, the API's JSON shape for /api/ and /metrics (platform_/errors.py).
handler400 = "platform_.errors.json_400"
handler403 = "platform_.errors.json_403"
handler404 = "platform_.errors.json_404"
handler500 = "platform_.errors.json_500"
