from django.urls import path

from . import views

urlpatterns = [
    path("runs/", views.RunListView.as_view(), name="run-list"),
    path("runs/<int:pk>/", views.RunDetailView.as_view(), name="run-detail"),
    path("runs/<int:pk>/cancel/", views.RunCancelView.as_view(), name="run-cancel"),
    path("runs/<int:pk>/resume/", views.RunResumeView.as_view(), name="run-resume"),
    path("runs/<int:pk>/tokens/", views.RunTokenView.as_view(), name="run-tokens"),
    path("runs/<int:pk>/status/", views.RunStatusView.as_view(), name="run-status"),
    path("runs/<int:pk>/samples/", views.RunSamplesView.as_view(), name="run-samples"),
    path("runs/<int:pk>/checkpoints/", views.RunCheckpointsView.as_view(), name="run-checkpoints"),
    path("runs/<int:pk>/exports/", views.RunExportsView.as_view(), name="run-exports"),
    path("runs/<int:pk>/model/", views.RunModelView.as_view(), name="run-model"),
    path("runs/<int:pk>/model/save/", views.RunModelSaveView.as_view(), name="run-model-save"),
    path("prompt-preview/", views.PromptPreviewView.as_view(), name="prompt-preview"),
]
