from django.contrib import admin

from .models import ApiToken, Membership, Organisation, RunToken, Team


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0


@admin.register(Organisation)
class OrganisationAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "engine_share", "created_at"]  # engine_share: for all its teams together
    search_fields = ["slug", "name"]


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    # engine_share and organisation: the operator's, per team (the API sets neither)
    list_display = ["slug", "name", "organisation", "engine_share", "created_at"]
    list_filter = ["organisation"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ["prefix", "user", "name", "scopes", "team", "expires_at", "last_used_at", "revoked_at"]
    readonly_fields = ["prefix", "key_hash", "last_used_at", "created_at"]


@admin.register(RunToken)
class RunTokenAdmin(admin.ModelAdmin):
    list_display = ["prefix", "run", "minted_by", "expires_at", "revoked_at"]
    readonly_fields = ["prefix", "key_hash", "run", "minted_by", "minted_with", "created_at"]
