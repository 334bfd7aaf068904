from django.urls import path

from . import views

urlpatterns = [
    path("me/", views.MeView.as_view(), name="me"),
    path("teams/", views.TeamListView.as_view(), name="team-list"),
    path("teams/<slug:slug>/", views.TeamDetailView.as_view(), name="team-detail"),
    path("teams/<slug:slug>/report-defaults/", views.TeamReportDefaultsView.as_view(), name="team-report-defaults"),
    path("teams/<slug:slug>/members/", views.TeamMemberListView.as_view(), name="team-members"),
    path("teams/<slug:slug>/members/<str:username>/", views.TeamMemberDetailView.as_view(), name="team-member"),
    path("tokens/", views.ApiTokenListView.as_view(), name="token-list"),
    path("tokens/<int:pk>/", views.ApiTokenDetailView.as_view(), name="token-detail"),
]
