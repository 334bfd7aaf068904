"""Create the first administrator of a deployment: a user who is admin of a team, with the
password typed at the prompt or read from FLUXRL_ADMIN_PASSWORD (never a default).

    docker compose exec web python manage.py create_admin --username alice --team acme

Refuses a user that exists already (change a password with `manage.py changepassword`) and
a password the validators refuse (AUTH_PASSWORD_VALIDATORS)."""
import getpass
import os

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from fluxrl.accounts.models import Membership, Role, Team

PASSWORD_ENV = "FLUXRL_ADMIN_PASSWORD"


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser):
        parser.add_argument("--username", required=True)
        parser.add_argument("--team", required=True, help="team slug (created if new)")
        parser.add_argument("--email", default="")

    def handle(self, username, team, email, **options):
        User = get_user_model()
        if User.objects.filter(username=username).exists():
            raise CommandError(f"user '{username}' exists already")
        password = os.environ.get(PASSWORD_ENV) or self._prompt()
        try:
            validate_password(password, User(username=username, email=email))
        except ValidationError as exc:
            raise CommandError("password refused: " + " ".join(exc.messages)) from None
        with transaction.atomic():
            user = User.objects.create_user(username=username, email=email, password=password,
                                            is_staff=True, is_superuser=True)
            team_obj, _ = Team.objects.get_or_create(slug=team, defaults={"name": team.title()})
            Membership.objects.update_or_create(user=user, team=team_obj, defaults={"role": Role.ADMIN})
        self.stderr.write(f"admin '{username}' created, admin of team '{team}'")

    def _prompt(self) -> str:
        if not os.isatty(0):
            raise CommandError(f"no terminal to type the password at: set {PASSWORD_ENV}")
        password = getpass.getpass("Password: ")
        if password != getpass.getpass("Password (again): "):
            raise CommandError("the passwords differ")
        return password
