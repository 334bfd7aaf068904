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
import json
import logging
import os
import secrets
import shutil
import sys
import time
from typing import Optional

from workers.io import wire
from workers.rollout.engine import RolloutEngine
from workers.rollout.engine_args import configure_cpu_environment
from workers.rollout.engine_types import SamplingOptions, UpdateTiming
from workers.rollout.fair_seats import FairSeats
from workers.rollout.messages import (REQUESTS, HandOffRequest, JoinGroupRequest, PoolView, SleepRequest,
                                      StartRequest, TenantInfo, UpdateRequest, WakeRequest, WeightsByBroadcast)
from workers.rollout.pool_registry import (SLOTS_ENV, PoolConfig, entry_of, pool_key, process_start, read_registry,
                                           registry_file, registry_lock, write_registry)
from workers.rollout.server import _Server
from workers.rollout.tickets import VERIFIER_ENV, TicketError, read_ticket
from workers.weights.update import FileWeights, WeightUpdate

log = logging.getLogger(__name__)

SHARE_WINDOW_S = 30.0  # a run's measured share: of the tokens generated over this long
# The most seats one grant hands out, so one vLLM request of a piece of a group: a group
# larger is split (TenantEngine.stream_group), at the cost of a prefill of its prompt per piece.
MAX_GRANT = 64
UNVERIFIED = "unverified"  # the tenant of every run on a platform's pool without a valid ticket


class PoolFull(RuntimeError):
    """Every adapter slot of the pool is taken."""


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
        elif isinstance(request, self.REFUSED) or (isinstance(request, UpdateRequest)
                                                            and isinstance(request.weights, WeightsByBroadcast)):
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
    owner = {"pid": os.getpid(), "nonce": secrets.token_hex(16), "process_start": process_start(os.getpid())}
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
                    with registry_lock(config.pool_id):
                        info = read_registry(config.pool_id)
                        if entry_of(info, owner):
                            write_registry(config.pool_id, {**info, "closing": True})
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
        with contextlib.suppress(OSError), registry_lock(config.pool_id):
            if entry_of(read_registry(config.pool_id), owner):  # another pool's entry stays
                registry_file(config.pool_id).unlink(missing_ok=True)


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
