"""Create (or reuse) a demo user, team and API token, and print the token's key.

Idempotent: the user and team are reused; the previous demo token is revoked and a new
one printed (only hashes are stored), unless --key fixes the key to use.
stdout carries the key alone, so `TOKEN=$(python manage.py bootstrap_demo)` works."""
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from fluxrl.accounts import services
from fluxrl.accounts.models import ApiToken, Membership, Role, Team

TOKEN_NAME = "demo"


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser):
        parser.add_argument("--username", default="demo")
        parser.add_argument("--password", default="demo", help="for the browser login")
        parser.add_argument("--team", default="demo", help="team slug")
        parser.add_argument("--key", help=f"use this key (must start with {services.USER_KEY_PREFIX})")

    @transaction.atomic
    def handle(self, username, password, team, key, **options):
        if key and (not key.startswith(services.USER_KEY_PREFIX) or len(key) < 32):
            raise CommandError(f"--key must start with {services.USER_KEY_PREFIX} and be at least 32 characters")
        user, created = get_user_model().objects.get_or_create(username=username)
        if created:
            user.set_password(password)
            user.save()
        team_obj, _ = Team.objects.get_or_create(slug=team, defaults={"name": team.title()})
        Membership.objects.update_or_create(user=user, team=team_obj, defaults={"role": Role.ADMIN})

        tokens = ApiToken.objects.filter(user=user, name=TOKEN_NAME, revoked_at__isnull=True)
        if key and tokens.filter(key_hash=services.hash_key(key)).exists():
            self.stdout.write(key)
            return
        for old in tokens:
            services.revoke_api_token(old)
        _, key = services.create_api_token(user, TOKEN_NAME, key=key)
        self.stderr.write(f"demo user '{username}' (password '{password}' if new), team '{team}'")
        self.stdout.write(key)
