"""Request rates: the API per user (DRF throttling, rate "user") and failed sign-ins per
client address (rate "login", every password login view: the dashboard's, the browsable
API's and the admin's). Both answer 429 with Retry-After. Counts live in Django's cache:
the default in-memory one counts per web process.

Rates are REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"] (FLUXRL_API_RATE, FLUXRL_LOGIN_RATE)."""
from __future__ import annotations

import logging
import math

from django.contrib.admin.sites import AdminSite
from django.contrib.auth.signals import user_login_failed
from django.contrib.auth.views import LoginView
from django.dispatch import receiver
from django.http import HttpResponse, JsonResponse
from rest_framework.settings import api_settings
from rest_framework.throttling import SimpleRateThrottle, UserRateThrottle

from fluxrl.accounts.models import RunToken

logger = logging.getLogger(__name__)


class CurrentRates:
    """The rate read from the settings when a throttle is made (DRF reads it once, at import)."""

    def get_rate(self):
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)


class ApiUserRateThrottle(CurrentRates, UserRateThrottle):
    """Each signed-in user's API requests (all their tokens and sessions together). Run
    tokens are the engines' reports, bounded per batch (FLUXRL_INGEST_*): not counted."""

    def allow_request(self, request, view):
        if isinstance(request.auth, RunToken):
            return True
        return super().allow_request(request, view)


class LoginFailureThrottle(CurrentRates, SimpleRateThrottle):
    """Failed sign-ins per client address (DRF's get_ident: REMOTE_ADDR, or X-Forwarded-For
    behind NUM_PROXIES proxies). Only failures count: a user signing in is never slowed."""

    scope = "login"

    def get_cache_key(self, request, view=None):
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}

    def allow_request(self, request, view=None):
        """True while the address has fewer than the rate's failures in its window (reads, records nothing)."""
        if self.rate is None:
            return True
        self.key = self.get_cache_key(request)
        self.now = self.timer()
        self.history = [t for t in self.cache.get(self.key, []) if t > self.now - self.duration]
        return len(self.history) < self.num_requests

    def record_failure(self, request) -> None:
        if self.rate is None:
            return
        self.allow_request(request)
        self.history.insert(0, self.now)
        self.cache.set(self.key, self.history, self.duration)


@receiver(user_login_failed, dispatch_uid="fluxrl-login-failures")
def count_login_failure(sender, credentials, request=None, **kwargs):
    if request is not None:  # None: authenticate() called outside a request (tests, shell)
        LoginFailureThrottle().record_failure(request)


def is_login_view(view_func) -> bool:
    view_class = getattr(view_func, "view_class", None)
    if isinstance(view_class, type) and issubclass(view_class, LoginView):
        return True
    return getattr(view_func, "__name__", "") == "login" and isinstance(getattr(view_func, "__self__", None), AdminSite)


class LoginThrottleMiddleware:
    """A password sign-in (POST to a login view) from an address with too many recent
    failures gets 429 before the password is checked."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_view(self, request, view_func, view_args, view_kwargs):
        if request.method != "POST" or not is_login_view(view_func):
            return None
        throttle = LoginFailureThrottle()
        if throttle.allow_request(request):
            return None
        wait = max(1, math.ceil(throttle.wait() or 1))
        logger.warning("sign-in refused for %s: %d failures within %s", throttle.get_ident(request),
                       len(throttle.history), throttle.rate)
        message = f"Too many failed sign-ins from this address; try again in {wait} s."
        if request.path.startswith("/api/"):
            from .errors import error_body  # not at the top: errors imports DRF's views, which import the parsers

            response = JsonResponse(error_body("throttled", message), status=429)
        else:
            response = HttpResponse(message, status=429, content_type="text/plain; charset=utf-8")
        response["Retry-After"] = str(wait)
        return response
