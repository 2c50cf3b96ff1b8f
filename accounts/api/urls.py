from django.urls import path
from rest_framework.routers import SimpleRouter

from accounts.api.usage import usage_view
from accounts.api.views import ApiKeyViewSet

router = SimpleRouter(trailing_slash=False)
router.register("keys", ApiKeyViewSet, basename="apikey")
urlpatterns = [path("usage", usage_view, name="usage"), *router.urls]
