from django.urls import path

from . import views

app_name = "dashboard"

urlpatterns = [
    path("", views.runs_list, name="runs"),
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", views.LogoutView.as_view(), name="logout"),
    path("team/", views.switch_team, name="switch-team"),
    path("runs/new/", views.new_run, name="new-run"),
    path("runs/<int:pk>/", views.run_detail, name="run"),
    path("runs/<int:pk>/log/", views.run_log, name="run-log"),
    path("compare/", views.compare, name="compare"),
    path("datasets/", views.datasets, name="datasets"),
    path("datasets/<int:pk>/", views.dataset_detail, name="dataset"),
    path("models/", views.stored_models, name="models"),
    path("rewards/", views.rewards, name="rewards"),
    path("rewards/<int:pk>/", views.rewards, name="reward"),
    path("vendor/plotly.min.js", views.plotly_js, name="plotly"),
]
