"""The platform's side of pool tickets (workers/rollout/tickets.py): the signing key, kept in
the platform's data folder, and each run's ticket, signed from the run's record.

The private key is FLUXRL_POOL_TICKET_KEY_FILE (default FLUXRL_DATA_DIR/pool-tickets.ed25519,
mode 600), made on first use; its public half
is the same path with ".pub", which runs name to the pools they start (FLUXRL_POOL_VERIFIER).
Only the public half and the ticket reach a run's environment."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from django.conf import settings

from workers.rollout.tickets import PoolTicket, new_signing_key, public_pem, sign_ticket

log = logging.getLogger(__name__)


def key_path() -> Path:
    return Path(settings.FLUXRL_POOL_TICKET_KEY_FILE or Path(settings.FLUXRL_DATA_DIR) / "pool-tickets.ed25519")


def verifier_path() -> Path:
    return key_path().with_name(f"{key_path().name}.pub")


def signing_key() -> bytes:
    """The private key (PEM), made with its public half on first use. Two workers starting
    runs at once make one: the first to create the file writes it, the other reads it."""
    path = key_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        private, _ = new_signing_key()
        with os.fdopen(fd, "wb") as fh:
            fh.write(private)
        log.info("made the pool ticket signing key %s", path)
    private = b""
    for _ in range(50):  # a key another process is writing this instant
        private = path.read_bytes()
        if private.rstrip().endswith(b"-----END PRIVATE KEY-----"):
            break
        time.sleep(0.01)
    public = public_pem(private)
    pub = verifier_path()
    if not pub.exists() or pub.read_bytes() != public:  # written whole, then renamed: a pool never reads half
        partial = pub.with_name(f"{pub.name}.{os.getpid()}.tmp")
        partial.write_bytes(public)
        partial.chmod(0o644)
        partial.replace(pub)
    return private


def pool_ticket(run_id: int, tenant: str, weight: float) -> str:
    """The run's ticket: its tenant and weight as the platform's records say, good for
    FLUXRL_POOL_TICKET_TTL_S."""
    ticket = PoolTicket(tenant=tenant, weight=weight, run=run_id,
                        expires=time.time() + settings.FLUXRL_POOL_TICKET_TTL_S)
    return sign_ticket(signing_key(), ticket)
