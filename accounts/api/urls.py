from rest_framework.routers import SimpleRouter

from accounts.api.views import ApiKeyViewSet

router = SimpleRouter(trailing_slash=False)
router.register("keys", ApiKeyViewSet, basename="apikey")
urlpatterns = [*router.urls]
