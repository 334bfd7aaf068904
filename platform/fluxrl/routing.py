"""Websocket routes, e.g. path("ws/runs/<int:run_id>/", RunConsumer.as_asgi())."""
websocket_urlpatterns: list = []
