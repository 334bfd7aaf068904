from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

urlpatterns = [
    path("", include("fluxrl.accounts.api.urls")),
    path("", include("fluxrl.datasets.api.urls")),
    path("", include("fluxrl.rewards.api.urls")),
    path("", include("fluxrl.runs.api.urls")),
    path("", include("fluxrl.metrics.api.urls")),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("redoc/", SpectacularRedocView.as_view(url_name="schema"), name="redoc"),
]
