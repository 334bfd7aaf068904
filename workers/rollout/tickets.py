"""Pool tickets: who a run is on a shared engine pool, and its weight, in the platform's words.

A run's share of a pool's engine is its tenant's weight (workers/rollout/pool.py). The run
cannot be the one to say it: every run's processes hold the node's pool key, so any of them
could claim any weight. The platform signs a ticket instead, from its own run record (the
tenant's key and ``engine_share``, the run's id, an expiry), and the pool believes the
ticket, not the run.

The signature is Ed25519, asymmetric on purpose: a run's processes start pools and could read
any secret a pool is given, so a shared key would let them sign for themselves. The platform
keeps the private key (under its own data folder, never in a run's environment); a run gets
the ticket (``FLUXRL_POOL_TICKET``) and the path of the public key (``FLUXRL_POOL_VERIFIER``),
which it hands to the pool it starts and which is part of the pool's id, so runs with a
verifier meet only pools that check with it.

A ticket is ``<payload>.<signature>``, both base64url: the payload is the ticket's JSON, and
the signature is over exactly those bytes, so nothing is re-serialised before it is checked.
"""
from __future__ import annotations

import base64
import binascii
import os
import time
from typing import Optional

from pydantic import Field, ValidationError

from workers.io import wire

TICKET_ENV = "FLUXRL_POOL_TICKET"
VERIFIER_ENV = "FLUXRL_POOL_VERIFIER"  # a file: the platform's public key (PEM)
MAX_TICKET_CHARS = 2000


class TicketError(ValueError):
    """A ticket that is not the platform's, is malformed, or has expired."""


class PoolTicket(wire.Message):
    """What the platform vouches for about a run on a shared engine pool."""
    tenant: str = Field(min_length=1, max_length=100)  # whose weight this is: a team's or an organisation's key
    weight: float = Field(gt=0, le=1000)
    run: int = Field(ge=0)  # the platform's run id (the pool's log names it)
    expires: float  # Unix time: a pool refuses the ticket from then on


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_signing_key() -> tuple[bytes, bytes]:
    """A fresh Ed25519 key pair as PEM: (private, public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return private, public_pem(private)


def public_pem(private_pem: bytes) -> bytes:
    """The public key (PEM) of a private key (PEM)."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(private_pem, password=None)
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def sign_ticket(private_pem: bytes, ticket: PoolTicket) -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = serialization.load_pem_private_key(private_pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("pool tickets are signed with an Ed25519 key")
    payload = ticket.model_dump_json().encode()
    return f"{_b64(payload)}.{_b64(key.sign(payload))}"


def read_ticket(text: str, verifier_pem: str, now: Optional[float] = None) -> PoolTicket:
    """The ticket, if ``verifier_pem`` (the platform's public key) signed it and it has not
    expired; else TicketError saying why."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if len(text) > MAX_TICKET_CHARS or text.count(".") != 1:
        raise TicketError("not a pool ticket")
    payload_b64, signature_b64 = text.split(".")
    try:
        payload, signature = _unb64(payload_b64), _unb64(signature_b64)
    except (binascii.Error, ValueError):
        raise TicketError("not a pool ticket (bad encoding)") from None
    try:
        key = serialization.load_pem_public_key(verifier_pem.encode())
    except ValueError as e:
        raise TicketError(f"the pool's verifier is not a public key: {e}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise TicketError("the pool's verifier is not an Ed25519 key")
    try:
        key.verify(signature, payload)
    except InvalidSignature:
        raise TicketError("its signature is not the platform's") from None
    try:
        ticket = PoolTicket.model_validate_json(payload)
    except ValidationError as e:
        raise TicketError(f"a signed ticket of another shape: {e.errors()[0]['msg']}") from None
    if ticket.expires <= (time.time() if now is None else now):
        raise TicketError(f"it expired at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(ticket.expires))} UTC")
    return ticket


def verifier_from_env() -> Optional[str]:
    """The platform's public key (PEM), from the file ``FLUXRL_POOL_VERIFIER`` names; None
    where it names none (a run without a platform)."""
    path = os.environ.get(VERIFIER_ENV)
    if not path:
        return None
    try:
        with open(path) as fh:
            text = fh.read(4096).strip()
    except OSError as e:
        raise RuntimeError(f"{VERIFIER_ENV} names {path}, which cannot be read: {e}") from None
    if "PUBLIC KEY" not in text:
        raise RuntimeError(f"{VERIFIER_ENV} names {path}, which holds no public key (PEM)")
    return text
