from django.urls import path

from . import views

urlpatterns = [
    path("models/", views.StoredModelListView.as_view(), name="model-list"),
    path("models/<int:pk>/", views.StoredModelDetailView.as_view(), name="model-detail"),
    path("models/<int:pk>/versions/", views.StoredModelVersionListView.as_view(), name="model-versions"),
    path("models/<int:pk>/versions/<int:version>/", views.StoredModelVersionDetailView.as_view(),
         name="model-version"),
]
