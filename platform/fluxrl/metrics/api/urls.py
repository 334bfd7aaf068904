from django.urls import path

from . import views

urlpatterns = [
    path("runs/<int:run_id>/metrics/", views.RunMetricsView.as_view(), name="run-metrics"),
]
