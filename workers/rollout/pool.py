"""Shared engine pools: LoRA runs of any team on one base model share vLLM engines.

A run with ``rollout.share_engines`` (and ``model.lora``) does not start engines of its
own. For each of its engines it joins a *pool*: one ``python -m workers engine-pool``
process on this node serving one vLLM engine with ``enable_lora`` and ``max_loras`` =
``FLUXRL_POOL_SLOTS`` slots. Runs whose engine settings match (base model, dtype, length
and batch caps, ...: :func:`pool_id`) find the same pool; the first one starts it, and it
exits once no run has used it for ``FLUXRL_POOL_IDLE_S``.

What each run keeps, on an engine it shares:

- **its adapter in a slot of its own.** The pool hands out the slot; a run's requests
  always generate with its own adapter and its updates load into its own slot: nothing
  in the protocol names another run's slot. Replies go only down the connection that
  asked. Prefix caching is off on every engine, so no run's prompts warm another's cache.
- **its policy versions.** vLLM labels every token with the engine's weight version,
  one number for the whole engine. A pool labels each adapter load with a counter of its
  own and keeps, per run, which of its versions each label stands for
  (:meth:`TenantEngine.policy_version`): a token's version is its run's, exactly.
- **its update mode** (keep or interrupt; drain would wait for other runs' requests) and
  its sampling settings. One run's update at a time: a keep-mode update pauses the
  engine's scheduler for every run (tens of ms), an interrupt-mode one aborts only the
  run's own requests.
- **its staleness bound**: admission stays in each run's own controller.
- **a fair share of generation** (:class:`FairSeats`): the engine's sequence seats
  (vLLM's ``max_num_seqs``) are shared by weighted fair queuing between the runs that
  want them, work-conserving (a run alone may use them all); a prompt group larger than
  its due is sent in pieces. A run's weight is its tenant's, from the ticket the platform
  signed from its records (workers/rollout/tickets.py), never from the run or its spec,
  divided among the tenant's runs on the pool.

A run that ends, fails or is killed closes its connection: its requests are aborted, its
adapter leaves vLLM and its slot is free; the other runs go on.

The pool listens on the wire (mutual TLS) with a key of this node's pools, a file only
this user can read (``FLUXRL_POOL_DIR``, default ``$TMPDIR/fluxrl-pools-<uid>``), where its
log is too (``<pool id>.log``: no run's log, which that run's team can read); a run's reward
code runs in a sandbox that sees none of it.
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Hashable, NamedTuple, Optional

from pydantic import Field

from workers.io import wire
from workers.io.lifetime import pid_alive, pid_namespace
from workers.rollout.engine import (RolloutEngine, SamplingOptions, UpdateTiming, configure_cpu_environment,
                                    lora_rank_class)
from workers.rollout.client import EngineClient
from workers.rollout.messages import (REPLIES, REQUESTS, EngineServerConfig, HandOffRequest, JoinGroupRequest, PoolView,
                                      SleepRequest, StartRequest, TenantInfo, UpdateRequest, WakeRequest)
from workers.rollout.server import _Server
from workers.rollout.tickets import TICKET_ENV, VERIFIER_ENV, TicketError, read_ticket, verifier_from_env
from workers.weights.update import FileWeights, WeightUpdate

log = logging.getLogger(__name__)

DIR_ENV, SLOTS_ENV, IDLE_ENV = "FLUXRL_POOL_DIR", "FLUXRL_POOL_SLOTS", "FLUXRL_POOL_IDLE_S"
CONNECT_ENV = "FLUXRL_POOL_CONNECT_S"  # how long a run keeps trying a live pool that does not take its connection
RANK_ENV, LENGTH_ENV = "FLUXRL_POOL_MAX_LORA_RANK", "FLUXRL_POOL_MAX_MODEL_LEN"
TEAM_ENV, RUN_ENV = "FLUXRL_POOL_TEAM", "FLUXRL_POOL_RUN"
SHARE_WINDOW_S = 30.0  # a run's measured share: of the tokens generated over this long
# The most seats one grant hands out, so one vLLM request of a piece of a group: a group
# larger is split (TenantEngine.stream_group), at the cost of a prefill of its prompt per piece.
MAX_GRANT = 64
UNVERIFIED = "unverified"  # the tenant of every run on a platform's pool without a valid ticket
# Never handed to a pool: it outlives the run that starts it and serves other teams' runs.
# (TICKET: the starting run's ticket is that run's, not the pool's.)
PRIVATE_ENV_PARTS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "TICKET", "DATABASE_URL", "REDIS_URL")


class PoolUnreachable(ConnectionError):
    """A live pool did not take the run's connection within ``FLUXRL_POOL_CONNECT_S`` (its
    entry stays: it is not dead), or a closing one did not exit within it."""


class PoolFull(RuntimeError):
    """Every adapter slot of the pool is taken."""


class PoolConfig(wire.Message):
    pool_id: str = Field(pattern=r"^[0-9a-f]{12}-[0-9]+$")
    engine: EngineServerConfig  # lora_rank: the largest adapter rank it serves
    slots: int = Field(4, ge=1, le=64)
    idle_exit_s: float = Field(120.0, ge=0)
    verifier: Optional[str] = Field(None, max_length=4096)  # the platform's public key (PEM): tickets.py


# -- fair sharing of an engine's seats -------------------------------------------------------
class _Want(NamedTuple):
    n: int  # seats wanted, at most the grant cap
    order: int  # arrival: the older of two equally deserving waiters goes first
    future: asyncio.Future  # resolved with the seats granted, 1 .. n


class FairSeats:
    """An engine's sequence seats (vLLM's ``max_num_seqs``) shared between runs. Holding a
    seat means being in vLLM's running batch, so seats are the share of every decode step.

    The policy is weighted fair queuing over seats held, by water-filling: every free seat
    goes, one at a time, to the waiting run whose seats held (with those given in this pass)
    divided by its weight is lowest, the oldest waiter first among equals. A seat held is
    seat-time accruing at the same rate for every run, so keeping held/weight level at every
    grant keeps each busy run's seat-time in proportion to its weight. Deficit round robin
    was the alternative; it charges a request its cost when it is sent, and a sequence's
    seat-time is known only when it ends.

    What holds whatever the requests' sizes:

    - a grant never exceeds the engine's seats nor ``max_grant``: a request wanting more
      gets what is free up to its due and asks again for the rest (TenantEngine splits a
      prompt group into pieces that way);
    - a grant is partial rather than waiting for room: a large request never leaves a seat
      idle while it waits, so it blocks nobody, and it is never starved, since a run with
      nothing held is the most deserving there is;
    - a run alone may hold every seat (work-conserving), and nothing running is preempted:
      a seat changes hands when its sequence ends (``release``)."""

    def __init__(self, capacity: int, max_grant: Optional[int] = None):
        self.capacity = capacity
        self.max_grant = max(1, min(capacity, max_grant or capacity))
        self.held: dict[Hashable, int] = collections.defaultdict(int)
        self.weights: dict[Hashable, float] = {}
        self._waiting: dict[Hashable, collections.deque[_Want]] = collections.defaultdict(collections.deque)
        self._arrivals = itertools.count()

    @property
    def used(self) -> int:
        return sum(self.held.values())

    def set_weight(self, key: Hashable, weight: float) -> None:
        self.weights[key] = weight
        self._grant()

    def forget(self, key: Hashable) -> None:
        """A run that left: its waiters fail, its seats are free."""
        for want in self._waiting.pop(key, ()):
            if not want.future.done():
                want.future.cancel()
        self.held.pop(key, None)
        self.weights.pop(key, None)
        self._grant()

    @contextlib.asynccontextmanager
    async def seats(self, key: Hashable, n: int):
        """Up to ``n`` seats while the block runs; yields how many."""
        granted = await self.acquire(key, n)
        try:
            yield granted
        finally:
            self.release(key, granted)

    async def acquire(self, key: Hashable, n: int) -> int:
        """Between 1 and ``min(n, max_grant)`` seats, once the fair order reaches them:
        returns how many. The caller releases each as its sequence ends."""
        if n < 1:
            raise ValueError(f"a request for {n} seats")
        future = asyncio.get_running_loop().create_future()
        want = _Want(min(n, self.max_grant), next(self._arrivals), future)
        self._waiting[key].append(want)
        self._grant()
        try:
            return await future
        except asyncio.CancelledError:
            if want in self._waiting.get(key, ()):
                self._waiting[key].remove(want)
            elif future.done() and not future.cancelled():  # granted as we were cancelled: give them back
                self.release(key, future.result())
            raise

    def release(self, key: Hashable, n: int) -> None:
        if key in self.held:
            self.held[key] = max(0, self.held[key] - n)
        self._grant()

    def _head(self, key: Hashable) -> Optional[_Want]:
        queue = self._waiting.get(key)
        while queue and queue[0].future.done():  # cancelled meanwhile
            queue.popleft()
        return queue[0] if queue else None

    def _grant(self) -> None:
        free = self.capacity - self.used
        given: dict[Hashable, int] = {}  # to the heads, this pass, not yet handed over
        while free > 0:
            best, best_rank = None, None
            for key in list(self._waiting):
                head = self._head(key)
                if head is None:
                    continue
                rank = ((self.held.get(key, 0) + given.get(key, 0)) / self.weights.get(key, 1.0), head.order)
                if best_rank is None or rank < best_rank:
                    best, best_rank = key, rank
            if best is None:
                break
            given[best] = given.get(best, 0) + 1
            free -= 1
            if given[best] == self._waiting[best][0].n:  # that head is whole: the run's next request may follow
                self._hand_over(best, given.pop(best))
        for key, n in given.items():  # the rest: partial grants
            self._hand_over(key, n)

    def _hand_over(self, key: Hashable, n: int) -> None:
        want = self._waiting[key].popleft()
        self.held[key] += n
        want.future.set_result(n)


# -- a run's view of the shared engine ---------------------------------------------------------
class TenantEngine(RolloutEngine):
    """One run on the pool's engine: ``RolloutEngine``'s interface (generation, updates,
    hand-off, per-token versions) over the shared vLLM engine, with its own adapter slot,
    requests, counters and versions."""

    def __init__(self, pool: "EnginePool"):
        base = pool.base
        super().__init__(base.model_path, index=base.index, max_model_len=base.max_model_len,
                         max_num_seqs=base.max_num_seqs, dtype=base.dtype, seed=base.seed,
                         rpc_timeout_s=base.rpc_timeout_s, lora_rank=base.lora_rank)
        self.pool = pool
        self.engine = base.engine
        self._update_lock = pool.update_lock
        self.tenant: Optional[TenantInfo] = None
        self.slot: Optional[int] = None
        self.serial: Optional[int] = None  # this join's number in the pool: its share's key (slots are reused)
        self.team: Optional[str] = None  # whose weight it shares: the ticket's tenant (EnginePool.identify)
        self.weight = 1.0
        self._labels: list[tuple[int, int]] = []  # (pool label, this run's version), ascending
        self._checksum: Optional[str] = None

    async def start(self, weights: Optional[WeightUpdate] = None, version: int = 0) -> None:
        t = self.tenant
        if t is None:
            raise ValueError("a run joins a shared engine pool saying who it is (StartRequest.tenant)")
        if self.slot is not None:
            raise ValueError("this run has joined the pool already")
        if t.lora_rank > self.lora_rank:
            raise ValueError(f"this pool serves adapters up to rank {self.lora_rank}; model.lora.rank is {t.lora_rank}")
        seats = self.pool.seats.capacity
        if t.group_size > seats:
            raise ValueError(f"algorithm.group_size {t.group_size} is more than the {seats} seats of this shared "
                             f"engine pool (rollout.max_num_seqs): a group's samples could never run side by side")
        self.team, self.weight = self.pool.identify(t)
        self.update_mode = t.update_mode
        self.sampling = SamplingOptions(t.top_p, t.top_k, tuple(t.stop), tuple(t.stop_token_ids))
        self.slot = self.lora_id = self.pool.join(self)
        self.version = version
        self._labels = [(self.pool.label, version)]
        if weights is not None:
            async with self._update_lock:
                await self._load(weights)

    def _joined(self) -> None:
        if self.slot is None:
            raise RuntimeError("join the pool first (start)")

    def policy_version(self, label: int) -> int:
        i = bisect.bisect_right(self._labels, (label, float("inf"))) - 1
        return self._labels[max(i, 0)][1]

    def engine_label(self, version: int) -> int:
        label = self.pool.next_label()
        self._labels.append((label, version))
        return label

    async def generate(self, prompt_ids, max_tokens, temperature, seed=None, ignore_eos=False, priority=0):
        self._joined()
        async with self.pool.seats.seats(self.slot, 1):
            return await super().generate(prompt_ids, max_tokens, temperature, seed, ignore_eos, priority)

    async def stream_group(self, prompt_ids, n, max_tokens, temperature, seed=None, ignore_eos=False, priority=0):
        """``RolloutEngine.stream_group`` in pieces of the seats the pool grants: each piece is
        a vLLM request of its own, sent as its seats are granted (``FairSeats``), so a group
        never holds more than its fair share of the seats, however large. The caller sees one
        group: indices 0 .. n-1, and with a seed, sample ``i`` samples with ``seed + i`` as
        in one request. A sample's seat is given back as the sample ends."""
        self._joined()
        seats, key = self.pool.seats, self.slot
        arrived: asyncio.Queue = asyncio.Queue()  # (index, Completion), or the error that ends the group
        tasks: list[asyncio.Task] = []

        def failed(task: asyncio.Task) -> None:
            if task.cancelled():  # not by us (we cancel only on our way out): the run left the pool
                arrived.put_nowait(asyncio.CancelledError())
            elif task.exception() is not None:
                arrived.put_nowait(task.exception())

        async def piece(offset: int, size: int) -> None:
            running = size
            try:
                async with contextlib.aclosing(RolloutEngine.stream_group(
                        self, prompt_ids, size, max_tokens, temperature, None if seed is None else seed + offset,
                        ignore_eos, priority)) as samples:
                    async for index, comp in samples:
                        running -= 1
                        seats.release(key, 1)
                        arrived.put_nowait((offset + index, comp))
            finally:
                seats.release(key, running)

        async def split() -> None:
            offset = 0
            while offset < n:
                size = await seats.acquire(key, n - offset)
                task = asyncio.ensure_future(piece(offset, size))
                task.add_done_callback(failed)
                tasks.append(task)
                offset += size

        splitter = asyncio.ensure_future(split())
        splitter.add_done_callback(failed)
        try:
            for _ in range(n):
                item = await arrived.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for task in (splitter, *tasks):  # left running only by an error, a cancellation or an early stop
                task.cancel()
            await asyncio.gather(splitter, *tasks, return_exceptions=True)  # their requests aborted, seats back

    async def update_weights(self, weights: WeightUpdate, version: int) -> UpdateTiming:
        self._joined()
        if not isinstance(weights, FileWeights) or not weights.adapter:
            raise ValueError("a shared engine takes adapter files only (rollout.weight_transport rpc)")
        timing = await super().update_weights(weights, version)
        self._checksum = None
        return timing

    async def hand_off(self, count: int) -> int:
        self._joined()
        return await super().hand_off(count)

    async def weights_checksum(self) -> Optional[str]:
        """The checksum of this run's adapter as its last update loaded it (the engine's own
        checksum is of whichever run loaded last)."""
        self._joined()
        if self._checksum is None and self.lora_request is not None:
            from workers.weights.files import iter_weight_file
            from workers.weights.sync import combine_digests, tensor_digest

            path = os.path.join(self.lora_request.lora_path, "adapter_model.safetensors")
            self._checksum = await asyncio.to_thread(
                lambda: combine_digests({name: tensor_digest(t) for name, t in iter_weight_file(path)}))
        return self._checksum

    @property
    def dead(self) -> bool:
        return self.pool.base.dead

    def core_pids(self) -> list[int]:
        return self.pool.base.core_pids()

    def shutdown(self) -> None:  # the pool's engine is not this run's to stop: see leave
        pass

    async def leave(self) -> None:
        """Abort this run's requests, take its adapter out of vLLM, free its slot."""
        if self.slot is None:
            return
        slot, self.slot = self.slot, None
        try:
            if self.active and not self.dead:
                with contextlib.suppress(Exception):
                    await self._call("an abort", self.engine.abort(list(self.active)))
            if self.lora_request is not None and not self.dead:
                with contextlib.suppress(Exception):
                    await self._call("removing the adapter", self.engine.remove_lora(slot))
        finally:
            if self._lora_folder is not None:
                shutil.rmtree(self._lora_folder, ignore_errors=True)
                self._lora_folder = None
            self.lora_request = None
            self.pool.leave(slot, self)


class EnginePool:
    """One vLLM engine with ``slots`` LoRA slots, and the runs on it."""

    def __init__(self, config: PoolConfig):
        self.config = config
        e = config.engine
        self.base = RolloutEngine.from_config(e)  # pool_settings: keep mode, no sampling settings of a run's
        self.base.lora_slots = config.slots
        self.update_lock = asyncio.Lock()
        self.seats = FairSeats(e.max_num_seqs, max_grant=MAX_GRANT)
        self.tenants: dict[int, TenantEngine] = {}
        self.label = 0
        self.connections = 0
        self.joins = 0
        self.idle_since = time.monotonic()
        self._left_tokens = 0
        self._marks: collections.deque = collections.deque()  # (time, {slot: tokens}, total tokens)

    def join(self, tenant: TenantEngine) -> int:
        free = [s for s in range(1, self.config.slots + 1) if s not in self.tenants]
        if not free:
            raise PoolFull(f"shared engine pool {self.config.pool_id}: all {self.config.slots} adapter slots are "
                           f"taken ({SLOTS_ENV})")
        slot = free[0]
        self.tenants[slot] = tenant
        self.joins += 1
        tenant.serial = self.joins
        self._reweigh()
        log.info("pool %s: a run of %s joined (slot %d, weight %g; %d run(s) now)", self.config.pool_id,
                 tenant.team, slot, tenant.weight, len(self.tenants))
        return slot

    def leave(self, slot: int, tenant: TenantEngine) -> None:
        if self.tenants.get(slot) is tenant:
            del self.tenants[slot]
            self._left_tokens += tenant.generated_tokens
        self.seats.forget(slot)
        self._reweigh()
        self.idle_since = time.monotonic()
        log.info("pool %s: slot %d is free (%d run(s) left)", self.config.pool_id, slot, len(self.tenants))

    def next_label(self) -> int:
        self.label += 1
        return self.label

    def identify(self, tenant: TenantInfo) -> tuple[str, float]:
        """A joining run's tenant and weight: its ticket's, if the platform signed it, never
        the run's own word. A pool without a verifier (no platform on this node) takes the
        team a run names, at weight 1. On a platform's pool, a run whose ticket is missing,
        forged or expired joins as tenant "unverified" at weight 1, shared with every other
        such run, rather than being refused: a run's engine (re)joins unattended, and a key
        rotated or a ticket expired on the operator's side should cost a running job its
        weight, not the job; a forger gets no more than a run without a platform."""
        if self.config.verifier is None:
            if tenant.ticket is not None:
                log.warning("pool %s: a run brought a ticket, but this pool has no verifier (%s): it runs as "
                            "team %s at weight 1", self.config.pool_id, VERIFIER_ENV, tenant.team)
            return tenant.team, 1.0
        if tenant.ticket is None:
            log.warning("pool %s: a run without a ticket joined: it runs as %r at weight 1", self.config.pool_id,
                        UNVERIFIED)
            return UNVERIFIED, 1.0
        try:
            ticket = read_ticket(tenant.ticket, self.config.verifier)
        except TicketError as e:
            log.warning("pool %s: a run's ticket is refused (%s): it runs as %r at weight 1", self.config.pool_id,
                        e, UNVERIFIED)
            return UNVERIFIED, 1.0
        log.info("pool %s: run %d's ticket: tenant %s, weight %g", self.config.pool_id, ticket.run, ticket.tenant,
                 ticket.weight)
        return ticket.tenant, ticket.weight

    def _reweigh(self) -> None:
        """A run's weight: its tenant's, divided among the tenant's runs here."""
        teams = collections.Counter(t.team for t in self.tenants.values())
        for slot, t in self.tenants.items():
            self.seats.set_weight(slot, t.weight / teams[t.team])

    def view(self, tenant: TenantEngine) -> Optional[PoolView]:
        if tenant.slot is None:
            return None
        now = time.monotonic()
        tokens = {t.serial: t.generated_tokens for t in self.tenants.values()}
        total = self._left_tokens + sum(tokens.values())
        if not self._marks or now - self._marks[-1][0] >= 1.0:
            self._marks.append((now, tokens, total))
        while len(self._marks) > 1 and now - self._marks[1][0] >= SHARE_WINDOW_S:
            self._marks.popleft()
        _, before, total_before = self._marks[0]
        mine = tokens[tenant.serial] - before.get(tenant.serial, 0)
        share = min(1.0, max(0.0, mine / (total - total_before))) if total > total_before else 0.0
        weights = self.seats.weights
        fair = weights.get(tenant.slot, 0.0) / (sum(weights.values()) or 1.0)
        return PoolView(id=self.config.pool_id, slot=tenant.slot, slots=self.config.slots, runs=len(self.tenants),
                        teams=len({t.team for t in self.tenants.values()}), share=round(share, 4),
                        fair_share=round(fair, 4))


class _TenantServer(_Server):
    """One run's connection to the pool."""

    REFUSED = (SleepRequest, WakeRequest, JoinGroupRequest)
    TAKES_LOCAL_FILES = False

    def __init__(self, pool: EnginePool, channel: wire.Channel):
        super().__init__(pool.config.engine, channel, engine=TenantEngine(pool), standalone=False)
        self.pool = pool

    def pool_view(self) -> Optional[PoolView]:
        return self.pool.view(self.engine)

    async def _handle(self, request, blob):
        if isinstance(request, StartRequest):
            self.engine.tenant = request.tenant
        elif isinstance(request, self.REFUSED) or (isinstance(request, UpdateRequest) and request.collective_meta):
            raise ValueError(f"{request.kind} is not available on a shared engine")
        elif not isinstance(request, HandOffRequest) and self.engine.slot is None:
            raise RuntimeError(f"{request.kind} before the run joined the pool (start)")
        return await super()._handle(request, blob)

    async def close_engine(self) -> None:
        await asyncio.gather(*self.tasks, return_exceptions=True)  # cancelled: their requests abort
        await self.engine.leave()


# -- the pool's process --------------------------------------------------------------------------
async def _serve(config: PoolConfig, announce) -> None:
    pool = EnginePool(config)
    await pool.base.start()
    pool.idle_since = time.monotonic()  # idle from now: starting may take minutes (CUDA graphs)
    listener = wire.listen(config.engine.host, 0, key=pool_key())
    # what the registry entry says of this process: it removes an entry only if it is this
    owner = {"pid": os.getpid(), "nonce": secrets.token_hex(16), "process_start": _process_start(os.getpid())}
    announce({"address": wire.format_address(listener.address), **owner})
    log.info("pool %s: serving %s with %d adapter slots at %s", config.pool_id, config.engine.model_path,
             config.slots, wire.format_address(listener.address))
    servers: set[asyncio.Task] = set()

    def ended(task: asyncio.Task) -> None:
        servers.discard(task)
        pool.connections -= 1
        pool.idle_since = time.monotonic()

    try:
        while True:
            try:
                channel = await asyncio.to_thread(listener.accept, REQUESTS, 1.0)
            except TimeoutError:
                if pool.base.dead:
                    log.error("pool %s: its engine died: exiting", config.pool_id)
                    return
                # idle: no run has joined since the last one left or connected; a connection
                # that never joins (a refused or stuck start) does not keep the pool alive
                if not pool.tenants and time.monotonic() - pool.idle_since >= config.idle_exit_s:
                    # its entry says "closing" until the engine is down: a run that comes now
                    # waits for that instead of starting a second engine beside this one
                    with _registry_lock(config.pool_id):
                        info = _read_registry(config.pool_id)
                        if _names(info, owner):
                            _write_registry(config.pool_id, {**info, "closing": True})
                    log.info("pool %s: idle for %g s: exiting", config.pool_id, config.idle_exit_s)
                    return
                continue
            pool.connections += 1
            pool.idle_since = time.monotonic()
            task = asyncio.ensure_future(_TenantServer(pool, channel).run())
            servers.add(task)
            task.add_done_callback(ended)
    finally:
        listener.close()
        for task in list(servers):
            task.cancel()
        pool.base.shutdown()
        with contextlib.suppress(OSError), _registry_lock(config.pool_id):
            if _names(_read_registry(config.pool_id), owner):  # another pool's entry stays
                _registry_file(config.pool_id).unlink(missing_ok=True)


def serve_pool(config: PoolConfig) -> int:
    """``python -m workers engine-pool``: start the engine, announce the address on stdout
    (the launcher writes the registry), serve runs until idle."""
    os.environ.update(config.engine.env)
    configure_cpu_environment(config.engine.env.get("VLLM_CPU_OMP_THREADS_BIND"), config.engine.kv_cache_gb)
    # The launcher reads the address from stdout, and vLLM prints there while it starts:
    # the address gets the real stdout, everything else goes to stderr.
    sys.stdout.flush()
    announcements = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def announce(entry: dict) -> None:
        announcements.write(json.dumps(entry) + "\n")
        announcements.close()

    asyncio.run(_serve(config, announce))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as an engine server: vLLM's teardown is done, skip the interpreter's


# -- finding or starting a pool -----------------------------------------------------------------
def pool_dir() -> Path:
    """This node's pools: the registry and the key, readable by this user only."""
    folder = Path(os.environ.get(DIR_ENV) or Path(tempfile.gettempdir()) / f"fluxrl-pools-{os.getuid()}")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(f"{folder} ({DIR_ENV}) must be this user's and closed to others (mode 700)")
    return folder


def pool_key() -> bytes:
    """The key every pool on this node listens with, and every run's client presents."""
    path = pool_dir() / "pool.key"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
    text = ""
    for _ in range(50):  # a key another process is writing this instant
        text = path.read_text().strip()
        if len(text) == 64:
            break
        time.sleep(0.01)
    return bytes.fromhex(text)


def _registry_name(pool_id: str) -> str:
    """A pool's registry entry, lock and log are named by its id and this PID namespace: a
    container sharing the folder sees other pids (a pid of its registry could name an
    unrelated process here), so each namespace keeps entries of its own."""
    return f"{pool_id}.ns{pid_namespace()}"


def _registry_file(pid: str) -> Path:
    return pool_dir() / f"{_registry_name(pid)}.json"


@contextlib.contextmanager
def _registry_lock(pid: str):
    with open(pool_dir() / f"{_registry_name(pid)}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_registry(pid: str) -> Optional[dict]:
    try:
        return json.loads(_registry_file(pid).read_text())
    except (OSError, ValueError):
        return None


def _write_registry(pool_id: str, info: dict) -> None:
    """Replace the entry whole (a reader never sees half of one). Under the registry lock."""
    path = _registry_file(pool_id)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps(info))
    os.replace(staging, path)


def _names(info: Optional[dict], owner: dict) -> bool:
    """Whether a registry entry is the one the pool ``owner`` (its pid and nonce) announced."""
    return info is not None and info.get("pid") == owner["pid"] and info.get("nonce") == owner["nonce"]


def _process_start(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks after boot: /proc/<pid>/stat, field 22); None
    where unreadable. A pid and its start name one process: a pid alone may be reused."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pool_alive(info: Optional[dict]) -> bool:
    """Whether the process a registry entry names is still that pool: its pid lives and is the
    same process (the start the pool wrote; an entry without one: a pool's command line).
    Only this says a pool is gone: a connection that fails says nothing of it (a flood of
    silent connections, a slow accept)."""
    if info is None:
        return False
    try:
        pid = int(info["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    if not pid_alive(pid):
        return False
    recorded = info.get("process_start")
    if recorded is not None:
        now = _process_start(pid)
        return now is None or now == recorded
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True
    return b"engine-pool" in command


def pool_settings(run_engine: EngineServerConfig, lora_rank: int) -> tuple[str, EngineServerConfig]:
    """The pool a run's engine joins: its id, and the pool engine's settings. What must
    match for runs to share is the base model, how the engine is built and where the plan
    puts it (its devices or cores: the pool runs where its first run's plan said); the
    length cap is the model's own (up to ``FLUXRL_POOL_MAX_MODEL_LEN``, default 4096; a run
    that needs more gets a power of two above its need), so runs of different tasks meet,
    and the adapter rank cap the smallest vLLM rank class at or above the run's (or
    ``FLUXRL_POOL_MAX_LORA_RANK``, to let runs of different ranks meet at a cost). A run
    with a ticket verifier (``FLUXRL_POOL_VERIFIER``) meets only pools that check with it."""
    # vLLM pads every slot to max_lora_rank, and its LoRA kernels cost in proportion (on the
    # CPU rank 64 made rank-8 adapters generate 5x slower): by default a pool serves one
    # rank class, the run's
    floor = int(os.environ.get(RANK_ENV) or 1)
    rank = max(lora_rank_class(lora_rank), lora_rank_class(floor))
    length = max(1 << max(0, run_engine.max_model_len - 1).bit_length(), _model_length(run_engine.model_path))
    engine = run_engine.model_copy(update={
        "model_path": os.path.realpath(run_engine.model_path), "max_model_len": length, "lora_rank": rank,
        "seed": 0, "update_mode": "keep", "top_p": 1.0, "top_k": -1, "stop": [], "stop_token_ids": [],
        "sleep_mode": False, "accept_timeout_s": 0.0})
    shared = engine.model_dump(include={"model_path", "dtype", "max_model_len", "max_num_seqs", "kv_cache_gb",
                                        "gpu_memory_utilization", "cpu_single_process", "enforce_eager",
                                        "tensor_parallel", "priority_scheduling", "lora_rank", "host", "env"})
    verifier = verifier_from_env()
    if verifier is not None:  # a platform's runs meet only pools that check tickets with its key
        shared["verifier"] = hashlib.sha256(verifier.encode()).hexdigest()
    digest = hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:12]
    return f"{digest}-{run_engine.index}", engine


def _model_length(model_path: str) -> int:
    """The model's own context length (its config's), at most FLUXRL_POOL_MAX_MODEL_LEN."""
    cap = int(os.environ.get(LENGTH_ENV, "4096"))
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    return min(int(config.get("max_position_embeddings") or 0), cap)


def _pool_env(engine: EngineServerConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not any(part in k.upper() for part in PRIVATE_ENV_PARTS)}
    return {**env, **engine.env}


def connect_deadline() -> float:
    return float(os.environ.get(CONNECT_ENV, "60"))


def join_pool(run_engine: EngineServerConfig, lora_rank: int) -> tuple[str, int, str]:
    """The address and pid of the pool this run engine joins (started here if none runs),
    and its id. Under the registry's lock: two runs starting at once start one pool. A new
    pool is started only where the entry's process is verifiably gone (:func:`pool_alive`);
    one that is closing (idle) is waited for, up to ``FLUXRL_POOL_CONNECT_S``."""
    pid_, engine = pool_settings(run_engine, lora_rank)
    deadline = time.monotonic() + connect_deadline()
    while True:
        with _registry_lock(pid_):
            info = _read_registry(pid_)
            if not pool_alive(info):
                return _start_pool(pid_, engine)
            if not info.get("closing"):
                return info["address"], int(info["pid"]), pid_
        if time.monotonic() > deadline:
            raise PoolUnreachable(f"shared engine pool {pid_} (pid {info['pid']}) is closing and did not exit within "
                                  f"{connect_deadline():g} s ({CONNECT_ENV})")
        time.sleep(0.2)


def _start_pool(pid_: str, engine: EngineServerConfig) -> tuple[str, int, str]:
    """Start pool ``pid_`` and write its entry. Under its registry lock."""
    config = PoolConfig(pool_id=pid_, engine=engine, slots=int(os.environ.get(SLOTS_ENV, "4")),
                        idle_exit_s=float(os.environ.get(IDLE_ENV, "120")), verifier=verifier_from_env())
    pool_key()  # made before the pool reads it
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # A session of its own, not the run's: the pool outlives the run that started it.
    # Its log is its own, not the starting run's (which that run's team can read).
    with open(pool_dir() / f"{_registry_name(pid_)}.log", "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "workers", "engine-pool"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log_file, start_new_session=True,
                                env=_pool_env(engine), cwd=repo)
    proc.stdin.write(config.model_dump_json().encode())
    proc.stdin.close()
    line = proc.stdout.readline()
    if not line:
        code = proc.wait()
        raise RuntimeError(f"shared engine pool {pid_} exited with code {code} before listening (its log: "
                           f"{pool_dir() / f'{_registry_name(pid_)}.log'})")
    threading.Thread(target=_drain, args=(proc,), daemon=True).start()
    announced = json.loads(line)
    _write_registry(pid_, {**announced, "started_at": time.time(), "model_path": engine.model_path})
    log.info("started shared engine pool %s (pid %s) at %s", pid_, announced["pid"], announced["address"])
    return announced["address"], int(announced["pid"]), pid_


def forget_pool(pool_id: Optional[str], address: Optional[str]) -> bool:
    """Drop the registry entry that names ``address`` if its process is verifiably gone (a
    pool that cannot be reached but lives keeps it: a second pool beside it would double
    the engine). Whether it was dropped."""
    if pool_id is None:
        return False
    with _registry_lock(pool_id):
        info = _read_registry(pool_id)
        if info is not None and info.get("address") == address and not pool_alive(info):
            _registry_file(pool_id).unlink(missing_ok=True)
            return True
    return False


def _drain(proc: subprocess.Popen) -> None:
    proc.stdout.read()  # nothing more comes: the pool sends the rest of its output to its log
    proc.wait()  # reaped here: it may end long after the run that started it


def stop_pools() -> int:
    """Stop every pool of this node's PID namespace (tests, an operator): SIGKILL each process
    group; returns how many. Entries of other namespaces name pids that mean nothing here."""
    stopped = 0
    for path in pool_dir().glob(f"*.ns{pid_namespace()}.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            pid = int(json.loads(path.read_text())["pid"])
            os.killpg(pid, signal.SIGKILL)
            stopped += 1
        path.unlink(missing_ok=True)
    return stopped


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
            with _registry_lock(self.pool_id):
                info = _read_registry(self.pool_id)
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
