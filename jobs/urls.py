"""The jobs pages (jobs/views.py); the API lives under /api/v1/ (jobs/api/urls.py)."""

from django.urls import path

from jobs import views

app_name = "jobs"
urlpatterns = [
    path("", views.job_list, name="list"),
    path("rows/", views.job_list_rows, name="list-rows"),
    path("<int:pk>/", views.job_detail, name="detail"),
    path("<int:pk>/summary/", views.job_summary, name="summary"),
    path("<int:pk>/cancel/", views.job_cancel, name="cancel"),
    path("<int:pk>/retry/", views.job_retry, name="retry"),
]
