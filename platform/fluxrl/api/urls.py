from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from .permissions import IsTeamUser

urlpatterns = [
    path("", include("fluxrl.accounts.api.urls")),
    path("", include("fluxrl.datasets.api.urls")),
    path("", include("fluxrl.modelstore.api.urls")),
    path("", include("fluxrl.rewards.api.urls")),
    path("", include("fluxrl.environments.api.urls")),
    path("", include("fluxrl.runs.api.urls")),
    path("", include("fluxrl.metrics.api.urls")),
    path("", include("fluxrl.quotas.api.urls")),
    # The schema maps every endpoint: signed-in people only (401 otherwise; run tokens 403). The docs pages are
    # static shells that fetch it with the browser's session.
    path("schema/", SpectacularAPIView.as_view(permission_classes=[IsTeamUser]), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("redoc/", SpectacularRedocView.as_view(url_name="schema"), name="redoc"),
]
