from django.urls import path

from . import views

urlpatterns = [
    path("runs/<int:pk>/metrics/", views.RunMetricsView.as_view(), name="run-metrics"),
]
