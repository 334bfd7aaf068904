"""A run's engine on a shared pool (workers/rollout/pool.py): ``PoolClient``, an
``EngineClient`` that joins (or starts) the pool its settings name, and ``tenant_info``,
who the run is there."""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

from workers.io import wire
from workers.rollout.client import EngineClient
from workers.rollout.messages import REPLIES, EngineServerConfig, TenantInfo
from workers.rollout.pool_registry import (CONNECT_ENV, PoolUnreachable, connect_deadline, forget_pool, join_pool,
                                           pool_alive, pool_key, read_registry, registry_lock)
from workers.rollout.tickets import TICKET_ENV
from workers.weights.update import WeightUpdate

log = logging.getLogger(__name__)

TEAM_ENV, RUN_ENV = "FLUXRL_POOL_TEAM", "FLUXRL_POOL_RUN"


class PoolClient(EngineClient):
    """A run's engine on a shared pool: ``EngineClient`` over the pool's connection."""

    def __init__(self, config: EngineServerConfig, tenant: TenantInfo):
        super().__init__(config)
        self.tenant = tenant
        self.pool_id: Optional[str] = None

    def _launch(self) -> tuple[str, int]:
        address, pid, self.pool_id = join_pool(self.config, self.tenant.lora_rank)
        self.key = pool_key()
        return address, pid

    def _connect(self) -> wire.Channel:
        """The pool's connection, trying again until ``FLUXRL_POOL_CONNECT_S``: a failed connect
        is not a dead pool (silent connections may hold its handshake slots a moment). Only a
        pool whose process is verifiably gone loses its entry and is replaced (a new one
        started, or the one another run started meanwhile joined); one that is closing is
        waited for (join_pool)."""
        deadline = time.monotonic() + connect_deadline()
        delay = 0.1
        while True:
            try:
                return wire.connect(wire.parse_address(self.address), REPLIES, self.key)
            except wire.KeyRefused:  # another key: trying again will not change it
                raise
            except OSError as exc:
                failure = exc
            with registry_lock(self.pool_id):
                info = read_registry(self.pool_id)
            current = (info is not None and info.get("address") == self.address and not info.get("closing")
                       and pool_alive(info))
            if not current:  # gone, closing, or replaced: whatever now serves this pool id
                forget_pool(self.pool_id, self.address)
                was = (self.address, self.server_pid)
                self.address, self.server_pid, self.pool_id = join_pool(self.config, self.tenant.lora_rank)
                log.warning("rollout engine %d: shared engine pool %s at %s (pid %s) is gone or closing (%s): now "
                            "%s (pid %s)", self.index, self.pool_id, was[0], was[1], failure, self.address,
                            self.server_pid)
                deadline, delay = time.monotonic() + connect_deadline(), 0.1
                continue
            if time.monotonic() + delay > deadline:
                raise PoolUnreachable(f"shared engine pool {self.pool_id} at {self.address} (pid {self.server_pid}) "
                                      f"lives but did not take a connection within {connect_deadline():g} s "
                                      f"({CONNECT_ENV}): {type(failure).__name__}: {failure}") from failure
            log.info("rollout engine %d: shared engine pool %s at %s did not take the connection (%s): trying "
                     "again", self.index, self.pool_id, self.address, failure)
            time.sleep(delay)
            delay = min(2.0, delay * 2)

    async def start(self, weights: Optional[WeightUpdate] = None, version: int = 0) -> None:
        try:
            await super().start(weights, version)
        except BaseException:
            self.shutdown()  # a refused join: its connection would only keep the pool awake
            raise


def tenant_info(run_label: str, lora_rank: int, update_mode: str, top_p: float, top_k: int, stop: list[str],
                stop_token_ids: list[int], group_size: int = 1) -> TenantInfo:
    """This run on a pool: its ticket from the platform's environment (``FLUXRL_POOL_TICKET``:
    its tenant and weight, signed), and the team it names (``FLUXRL_POOL_TEAM``, default
    "local"), believed only by a pool without a verifier. A weight the run states itself is
    no weight: a run without a ticket has weight 1."""
    return TenantInfo(run=os.environ.get(RUN_ENV) or run_label, team=os.environ.get(TEAM_ENV) or "local",
                      ticket=os.environ.get(TICKET_ENV) or None, group_size=group_size, lora_rank=lora_rank,
                      update_mode=update_mode, top_p=top_p, top_k=top_k, stop=stop, stop_token_ids=stop_token_ids)
