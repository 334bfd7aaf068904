from django.urls import path

from . import views

urlpatterns = [
    path("rewards/", views.RewardListView.as_view(), name="reward-list"),
    path("rewards/try/", views.RewardTryAnyView.as_view(), name="reward-try"),
    path("rewards/<int:pk>/", views.RewardDetailView.as_view(), name="reward-detail"),
    path("rewards/<int:pk>/versions/", views.RewardVersionListView.as_view(), name="reward-versions"),
    path("rewards/<int:pk>/versions/<int:version>/", views.RewardVersionDetailView.as_view(), name="reward-version"),
    path("rewards/<int:pk>/try/", views.RewardTryView.as_view(), name="reward-function-try"),
]
