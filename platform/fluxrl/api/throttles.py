"""Request rates: the API per user (DRF throttling, rate "user") and failed sign-ins per
client address (rate "login") and per submitted username (rate "login_user"), on every
password login view: the dashboard's, the browsable API's and the admin's. All answer 429
with Retry-After. Counts live in Django's cache: the default in-memory one counts per web
process.

The client address is the peer's (REMOTE_ADDR): X-Forwarded-For is written by the client
and is read only behind proxies the settings name (client_address).

Rates are REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"] (FLUXRL_API_RATE, FLUXRL_LOGIN_RATE,
FLUXRL_LOGIN_USER_RATE)."""
from __future__ import annotations

import functools
import hashlib
import ipaddress
import logging
import math
import unicodedata

from django.conf import settings
from django.contrib.admin.sites import AdminSite
from django.contrib.auth import get_user_model
from django.contrib.auth.signals import user_login_failed
from django.contrib.auth.views import LoginView
from django.dispatch import receiver
from django.http import HttpResponse, JsonResponse
from rest_framework.settings import api_settings
from rest_framework.throttling import SimpleRateThrottle, UserRateThrottle

from fluxrl.accounts.models import RunToken

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def trusted_networks(entries: tuple[str, ...]) -> tuple:
    return tuple(ipaddress.ip_network(entry.strip(), strict=False) for entry in entries if entry.strip())


def parse_address(text: str):
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    return getattr(address, "ipv4_mapped", None) or address


def client_address(request) -> str:
    """The address rates count. REMOTE_ADDR, the peer, unless the settings name the proxies
    in front: with FLUXRL_TRUSTED_PROXIES (addresses/CIDRs) and a peer among them, the
    X-Forwarded-For hop just left of the trusted ones (hops further left are the client's
    own words); with FLUXRL_NUM_PROXIES=n, the n-th hop from the right (every request is
    then assumed to come through those n proxies)."""
    peer = request.META.get("REMOTE_ADDR", "") or ""
    trusted = trusted_networks(tuple(getattr(settings, "FLUXRL_TRUSTED_PROXIES", ()) or ()))
    num_proxies = int(getattr(settings, "FLUXRL_NUM_PROXIES", 0) or 0)
    if not trusted and not num_proxies:
        return peer
    hops = [hop.strip() for hop in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if hop.strip()]
    if not trusted:
        chosen = parse_address(hops[-min(num_proxies, len(hops))]) if hops else None
        return str(chosen) if chosen else peer
    address = parse_address(peer)
    if address is None or not any(address in net for net in trusted):
        return peer  # not through a proxy we trust: its header counts for nothing
    for hop in reversed(hops):
        hop_address = parse_address(hop)
        if hop_address is None:
            break  # a trusted proxy wrote no address: count the proxy, not what the client wrote
        address = hop_address
        if not any(address in net for net in trusted):
            break
    return str(address)


class PeerAddressIdent:
    """DRF's get_ident reads X-Forwarded-For whenever NUM_PROXIES is unset; this does not."""

    def get_ident(self, request):
        return client_address(request)


class CurrentRates:
    """The rate read from the settings when a throttle is made (DRF reads it once, at import)."""

    def get_rate(self):
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)


class ApiUserRateThrottle(PeerAddressIdent, CurrentRates, UserRateThrottle):
    """Each signed-in user's API requests (all their tokens and sessions together). Run
    tokens are the engines' reports, bounded per batch (FLUXRL_INGEST_*): not counted."""

    def allow_request(self, request, view):
        if isinstance(request.auth, RunToken):
            return True
        return super().allow_request(request, view)


class LoginFailureThrottle(PeerAddressIdent, CurrentRates, SimpleRateThrottle):
    """Failed sign-ins per client address (client_address). Only failures count: a user
    signing in is never slowed."""

    scope = "login"
    refusal = "Too many failed sign-ins from this address; try again in {wait} s."

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


def username_key(username) -> str:
    """One count per submitted name, whether or not such a user exists (so a 429 tells
    nothing about accounts); folded as the login form folds it, and case too."""
    folded = unicodedata.normalize("NFKC", str(username or "")).strip().casefold()
    return hashlib.sha256(folded.encode()).hexdigest()[:32]


class UsernameFailureThrottle(LoginFailureThrottle):
    """Failed sign-ins per submitted username, from any address: a guesser spread over
    many addresses against one account is held too."""

    scope = "login_user"
    refusal = "Too many failed sign-ins for this account: it is temporarily locked; try again in {wait} s."

    def __init__(self, username):
        super().__init__()
        self.username = username

    def get_cache_key(self, request, view=None):
        return self.cache_format % {"scope": self.scope, "ident": username_key(self.username)}


def submitted_username(request) -> str:
    field = get_user_model().USERNAME_FIELD
    return request.POST.get(field) or request.POST.get("username") or ""


@receiver(user_login_failed, dispatch_uid="fluxrl-login-failures")
def count_login_failure(sender, credentials, request=None, **kwargs):
    if request is not None:  # None: authenticate() called outside a request (tests, shell)
        LoginFailureThrottle().record_failure(request)
        field = get_user_model().USERNAME_FIELD
        UsernameFailureThrottle(credentials.get(field, credentials.get("username", ""))).record_failure(request)


def is_login_view(view_func) -> bool:
    view_class = getattr(view_func, "view_class", None)
    if isinstance(view_class, type) and issubclass(view_class, LoginView):
        return True
    return getattr(view_func, "__name__", "") == "login" and isinstance(getattr(view_func, "__self__", None), AdminSite)


class LoginThrottleMiddleware:
    """A password sign-in (POST to a login view) from an address, or for a username, with
    too many recent failures gets 429 before the password is checked."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_view(self, request, view_func, view_args, view_kwargs):
        if request.method != "POST" or not is_login_view(view_func):
            return None
        for throttle in (LoginFailureThrottle(), UsernameFailureThrottle(submitted_username(request))):
            if not throttle.allow_request(request):
                return self.refuse(request, throttle)
        return None

    @staticmethod
    def refuse(request, throttle):
        wait = max(1, math.ceil(throttle.wait() or 1))
        logger.warning("sign-in refused (%s) from %s: %d failures within %s", throttle.scope,
                       throttle.get_ident(request), len(throttle.history), throttle.rate)
        message = throttle.refusal.format(wait=wait)
        if request.path.startswith("/api/"):
            from .errors import error_body  # not at the top: errors imports DRF's views, which import the parsers

            response = JsonResponse(error_body("throttled", message), status=429)
        else:
            response = HttpResponse(message, status=429, content_type="text/plain; charset=utf-8")
        response["Retry-After"] = str(wait)
        return response
