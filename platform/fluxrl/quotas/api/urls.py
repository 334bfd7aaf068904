from django.urls import path

from . import views

urlpatterns = [
    path("teams/<slug:slug>/quota/", views.TeamQuotaView.as_view(), name="team-quota"),
]
