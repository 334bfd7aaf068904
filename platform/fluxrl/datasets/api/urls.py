from django.urls import path

from . import views

urlpatterns = [
    path("datasets/", views.DatasetListView.as_view(), name="dataset-list"),
    path("datasets/generators/", views.GeneratorListView.as_view(), name="dataset-generators"),
    path("datasets/generate/", views.DatasetGenerateView.as_view(), name="dataset-generate"),
    path("datasets/import/", views.DatasetImportView.as_view(), name="dataset-import"),
    path("datasets/<int:pk>/", views.DatasetDetailView.as_view(), name="dataset-detail"),
    path("datasets/<int:pk>/versions/", views.DatasetVersionListView.as_view(), name="dataset-versions"),
    path("datasets/<int:pk>/versions/<int:version>/", views.DatasetVersionDetailView.as_view(), name="dataset-version"),
    path("datasets/<int:pk>/versions/<int:version>/preview/", views.DatasetPreviewView.as_view(), name="dataset-preview"),
    path("datasets/<int:pk>/versions/<int:version>/download/", views.DatasetDownloadView.as_view(), name="dataset-download"),
]
