from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", include("fluxrl.api.urls")),
    path("api-auth/", include("rest_framework.urls")),  # session login for the browsable API
    path("", include("fluxrl.dashboard.urls")),
]

handler404 = "fluxrl.api.errors.not_found"
handler500 = "fluxrl.api.errors.crashed"
