from django.urls import path

from . import views

urlpatterns = [
    path("environments/", views.EnvironmentListView.as_view(), name="environment-list"),
    path("environments/try/", views.EnvironmentTryAnyView.as_view(), name="environment-try"),
    path("environments/<int:pk>/", views.EnvironmentDetailView.as_view(), name="environment-detail"),
    path("environments/<int:pk>/versions/", views.EnvironmentVersionListView.as_view(), name="environment-versions"),
    path("environments/<int:pk>/versions/<int:version>/", views.EnvironmentVersionDetailView.as_view(),
         name="environment-version"),
    path("environments/<int:pk>/try/", views.EnvironmentTryView.as_view(), name="environment-saved-try"),
]
