from django.urls import path
from rest_framework.routers import SimpleRouter

from jobs.api.callbacks import CallbackSecretView
from jobs.api.views import JobViewSet

router = SimpleRouter(trailing_slash=False)
router.register("jobs", JobViewSet, basename="job")
urlpatterns = [
    path("callback-secret", CallbackSecretView.as_view(), name="callback-secret"),
    *router.urls,
]
