"""The keys and usage pages (accounts/views.py); the API is under /api/v1/ (accounts/api/urls.py)."""

from django.urls import path

from accounts import views

app_name = "accounts"
urlpatterns = [
    path("keys/", views.keys_page, name="keys"),
    path("keys/<int:pk>/revoke/", views.revoke_key, name="revoke"),
    path("usage/", views.usage_page, name="usage"),
]
