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
  (vLLM's ``max_num_seqs``) are shared by weighted max-min fairness between the runs
  that want them, work-conserving (a run alone may use them all). A run's weight is its
  team's (``FLUXRL_POOL_WEIGHT``, set by the platform from the team's record, never by
  the spec) divided among the team's runs on the pool.

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
from typing import Hashable, Optional

from pydantic import Field

from workers.io import wire
from workers.io.lifetime import pid_alive, pid_namespace
from workers.rollout.engine import RolloutEngine, SamplingOptions, configure_cpu_environment, lora_rank_class
from workers.rollout.client import EngineClient
from workers.rollout.messages import (REQUESTS, EngineServerConfig, HandOffRequest, JoinGroupRequest, PoolView,
                                      SleepRequest, StartRequest, TenantInfo, UpdateRequest, WakeRequest)
from workers.rollout.server import _Server

log = logging.getLogger(__name__)

DIR_ENV, SLOTS_ENV, IDLE_ENV = "FLUXRL_POOL_DIR", "FLUXRL_POOL_SLOTS", "FLUXRL_POOL_IDLE_S"
RANK_ENV, LENGTH_ENV = "FLUXRL_POOL_MAX_LORA_RANK", "FLUXRL_POOL_MAX_MODEL_LEN"
TEAM_ENV, WEIGHT_ENV, RUN_ENV = "FLUXRL_POOL_TEAM", "FLUXRL_POOL_WEIGHT", "FLUXRL_POOL_RUN"
SHARE_WINDOW_S = 30.0  # a run's measured share: of the tokens generated over this long
# Never handed to a pool: it outlives the run that starts it and serves other teams' runs.
PRIVATE_ENV_PARTS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "DATABASE_URL", "REDIS_URL")


class PoolFull(RuntimeError):
    """Every adapter slot of the pool is taken."""


class PoolConfig(wire.Message):
    pool_id: str = Field(pattern=r"^[0-9a-f]{12}-[0-9]+$")
    engine: EngineServerConfig  # lora_rank: the largest adapter rank it serves
    slots: int = Field(4, ge=1, le=64)
    idle_exit_s: float = Field(120.0, ge=0)


# -- fair sharing of an engine's seats -------------------------------------------------------
class FairSeats:
    """An engine's sequence seats (vLLM's ``max_num_seqs``) shared between runs by
    weighted max-min fairness: the next request to run is the head of the run holding the
    fewest seats for its weight, once it fits; a run alone may hold them all
    (work-conserving). Holding a seat means being in vLLM's running batch, so seats are
    the share of every decode step."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.held: dict[Hashable, int] = collections.defaultdict(int)
        self.weights: dict[Hashable, float] = {}
        self._waiting: dict[Hashable, collections.deque] = collections.defaultdict(collections.deque)

    @property
    def used(self) -> int:
        return sum(self.held.values())

    def set_weight(self, key: Hashable, weight: float) -> None:
        self.weights[key] = weight
        self._grant()

    def forget(self, key: Hashable) -> None:
        """A run that left: its waiters fail, its seats are free."""
        for _, future in self._waiting.pop(key, ()):
            if not future.done():
                future.cancel()
        self.held.pop(key, None)
        self.weights.pop(key, None)
        self._grant()

    @contextlib.asynccontextmanager
    async def seats(self, key: Hashable, n: int):
        await self.acquire(key, n)
        try:
            yield
        finally:
            self.release(key, n)

    async def acquire(self, key: Hashable, n: int) -> None:
        future = asyncio.get_running_loop().create_future()
        entry = (n, future)
        self._waiting[key].append(entry)
        self._grant()
        try:
            await future
        except asyncio.CancelledError:
            if entry in self._waiting.get(key, ()):
                self._waiting[key].remove(entry)
            elif future.done() and not future.cancelled():  # granted as we were cancelled: give them back
                self.release(key, n)
            raise

    def release(self, key: Hashable, n: int) -> None:
        if key in self.held:
            self.held[key] = max(0, self.held[key] - n)
        self._grant()

    def _grant(self) -> None:
        while True:
            heads = [k for k, q in self._waiting.items() if q]
            if not heads:
                return
            key = min(heads, key=lambda k: self.held.get(k, 0) / self.weights.get(k, 1.0))
            n, future = self._waiting[key][0]
            used = self.used
            if used and used + n > self.capacity:  # the most deserving waits for room; nobody overtakes it
                return
            self._waiting[key].popleft()
            if future.done():  # cancelled meanwhile
                continue
            self.held[key] += n
            future.set_result(None)


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
        self._labels: list[tuple[int, int]] = []  # (pool label, this run's version), ascending
        self._checksum: Optional[str] = None

    async def start(self, warm_blob=None, version: int = 0) -> None:
        t = self.tenant
        if t is None:
            raise ValueError("a run joins a shared engine pool saying who it is (StartRequest.tenant)")
        if self.slot is not None:
            raise ValueError("this run has joined the pool already")
        if t.lora_rank > self.lora_rank:
            raise ValueError(f"this pool serves adapters up to rank {self.lora_rank}; model.lora.rank is {t.lora_rank}")
        self.update_mode = t.update_mode
        self.sampling = SamplingOptions(t.top_p, t.top_k, tuple(t.stop), tuple(t.stop_token_ids))
        self.slot = self.lora_id = self.pool.join(self)
        self.version = version
        self._labels = [(self.pool.label, version)]
        if warm_blob is not None:
            async with self._update_lock:
                await self._load(warm_blob)

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
        self._joined()
        async with self.pool.seats.seats(self.slot, n):
            async with contextlib.aclosing(super().stream_group(prompt_ids, n, max_tokens, temperature, seed,
                                                                ignore_eos, priority)) as samples:
                async for item in samples:
                    yield item

    async def update_weights(self, weights, version: int):
        self._joined()
        if not hasattr(weights, "path"):
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
        self.base = RolloutEngine(
            e.model_path, index=e.index, max_model_len=e.max_model_len, max_num_seqs=e.max_num_seqs, dtype=e.dtype,
            seed=e.seed, rpc_timeout_s=e.rpc_timeout_s, gpu_memory_utilization=e.gpu_memory_utilization,
            cpu_single_process=e.cpu_single_process, enforce_eager=e.enforce_eager,
            tensor_parallel=e.tensor_parallel, priority_scheduling=e.priority_scheduling, lora_rank=e.lora_rank)
        self.base.lora_slots = config.slots
        self.update_lock = asyncio.Lock()
        self.seats = FairSeats(e.max_num_seqs)
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
        log.info("pool %s: a run of team %s joined (slot %d; %d run(s) now)", self.config.pool_id,
                 tenant.tenant.team, slot, len(self.tenants))
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

    def _reweigh(self) -> None:
        """A run's weight: its team's, divided among the team's runs here."""
        teams = collections.Counter(t.tenant.team for t in self.tenants.values())
        for slot, t in self.tenants.items():
            self.seats.set_weight(slot, t.tenant.weight / teams[t.tenant.team])

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
                        teams=len({t.tenant.team for t in self.tenants.values()}), share=round(share, 4),
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
    announce(wire.format_address(listener.address))
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
                    with _registry_lock(config.pool_id):  # no run finds it from now on
                        _registry_file(config.pool_id).unlink(missing_ok=True)
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
            info = _read_registry(config.pool_id)
            if info is not None and info.get("pid") == os.getpid():
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

    def announce(address: str) -> None:
        announcements.write(json.dumps({"address": address, "pid": os.getpid()}) + "\n")
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


def pool_settings(run_engine: EngineServerConfig, lora_rank: int) -> tuple[str, EngineServerConfig]:
    """The pool a run's engine joins: its id, and the pool engine's settings. What must
    match for runs to share is the base model, how the engine is built and where the plan
    puts it (its devices or cores: the pool runs where its first run's plan said); the
    length cap is the model's own (up to ``FLUXRL_POOL_MAX_MODEL_LEN``, default 4096; a run
    that needs more gets a power of two above its need), so runs of different tasks meet,
    and the adapter rank cap the smallest vLLM rank class at or above the run's (or
    ``FLUXRL_POOL_MAX_LORA_RANK``, to let runs of different ranks meet at a cost)."""
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


def join_pool(run_engine: EngineServerConfig, lora_rank: int) -> tuple[str, int, str]:
    """The address and pid of the pool this run engine joins (started here if none runs),
    and its id. Under the registry's lock: two runs starting at once start one pool."""
    pid_, engine = pool_settings(run_engine, lora_rank)
    with _registry_lock(pid_):
        info = _read_registry(pid_)
        if info is not None and pid_alive(int(info["pid"])):
            return info["address"], int(info["pid"]), pid_
        config = PoolConfig(pool_id=pid_, engine=engine, slots=int(os.environ.get(SLOTS_ENV, "4")),
                            idle_exit_s=float(os.environ.get(IDLE_ENV, "120")))
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
        _registry_file(pid_).write_text(json.dumps({**announced, "started_at": time.time(),
                                                    "model_path": engine.model_path}))
        log.info("started shared engine pool %s (pid %s) at %s", pid_, announced["pid"], announced["address"])
        return announced["address"], int(announced["pid"]), pid_


def forget_pool(pool_id: Optional[str], address: Optional[str]) -> None:
    """Drop a registry entry that names ``address`` (a pool that cannot be reached)."""
    if pool_id is None:
        return
    with _registry_lock(pool_id):
        info = _read_registry(pool_id)
        if info is not None and info.get("address") == address:
            _registry_file(pool_id).unlink(missing_ok=True)


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

    async def start(self, warm_blob=None, version: int = 0) -> None:
        try:
            try:
                await super().start(warm_blob, version)
            except (OSError, wire.WireError):
                if self.channel is not None:
                    raise
                # the pool was exiting (idle) as we found it, or died and left its entry: once
                # more, without that entry, which starts a new one
                forget_pool(self.pool_id, self.address)
                self.address = None
                await super().start(warm_blob, version)
        except BaseException:
            self.shutdown()  # a refused join: its connection would only keep the pool awake
            raise


def tenant_info(run_label: str, lora_rank: int, update_mode: str, top_p: float, top_k: int, stop: list[str],
                stop_token_ids: list[int]) -> TenantInfo:
    """This run on a pool: its team and weight from the platform's environment
    (``FLUXRL_POOL_TEAM``, ``FLUXRL_POOL_WEIGHT``; a run started by hand is team "local")."""
    return TenantInfo(run=os.environ.get(RUN_ENV) or run_label, team=os.environ.get(TEAM_ENV) or "local",
                      weight=float(os.environ.get(WEIGHT_ENV) or 1.0), lora_rank=lora_rank,
                      update_mode=update_mode, top_p=top_p, top_k=top_k, stop=stop, stop_token_ids=stop_token_ids)
