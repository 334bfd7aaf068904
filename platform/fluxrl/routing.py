"""Websocket routes: a run's live view (runs/consumers.py, docs/architecture.md §7)."""
from django.urls import path

from fluxrl.runs.consumers import RunConsumer

websocket_urlpatterns: list = [
    path("ws/runs/<int:run_id>/", RunConsumer.as_asgi()),
]
