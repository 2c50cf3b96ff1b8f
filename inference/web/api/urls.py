from django.urls import include, path

from inference.web.api import tokens, views

urlpatterns = [
    path("models", views.model_list, name="model-list"),
    path("models/<str:name>/predict", views.predict_view, name="model-predict"),
    path("health", views.health, name="health"),
    path("ready", views.ready, name="ready"),
    path("token/rotate", tokens.rotate_token, name="token-rotate"),
    path("", include("accounts.api.urls")),  # /api/v1/keys
]
