from django.urls import include, path

from inference.web.api import deployments, tokens, views

urlpatterns = [
    path("models", views.model_list, name="model-list"),
    path("models/<str:name>/predict", views.predict_view, name="model-predict"),
    # Staff: model versions (issue 21), inference/web/api/deployments.py.
    path("models/<str:name>/deployment", deployments.deployment, name="model-deployment"),
    path("models/<str:name>/promote", deployments.promote, name="model-promote"),
    path("models/<str:name>/canary", deployments.canary, name="model-canary"),
    path("health", views.health, name="health"),
    path("ready", views.ready, name="ready"),
    path("token/rotate", tokens.rotate_token, name="token-rotate"),
    path("", include("accounts.api.urls")),  # /api/v1/keys
]
