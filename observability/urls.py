"""The dashboard page, its data, and the Prometheus scrape endpoint (paths kept from platform_/urls.py)."""

from django.urls import path

from observability import dashboard, prometheus

urlpatterns = [
    path("dashboard/", dashboard.dashboard, name="dashboard"),
    path("dashboard/data.json", dashboard.dashboard_json, name="dashboard-data"),
    path("metrics", prometheus.metrics_view, name="metrics"),
]
