"""Finding or starting a shared engine pool (workers/rollout/pool.py): this node's pool folder
and key, the registry of live pools (one entry per pool id and PID namespace, under a
lock), whether an entry's process is still that pool, the pool id a run's engine settings
name, and the launcher that starts a pool process and records it."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from pydantic import Field

from workers.io import wire
from workers.io.lifetime import pid_alive, pid_namespace
from workers.rollout.engine_args import lora_rank_class
from workers.rollout.messages import PROTOCOL_VERSION, EngineServerConfig
from workers.rollout.tickets import verifier_from_env

log = logging.getLogger(__name__)

DIR_ENV, SLOTS_ENV, IDLE_ENV = "FLUXRL_POOL_DIR", "FLUXRL_POOL_SLOTS", "FLUXRL_POOL_IDLE_S"
CONNECT_ENV = "FLUXRL_POOL_CONNECT_S"  # how long a run keeps trying a live pool that does not take its connection
RANK_ENV, LENGTH_ENV = "FLUXRL_POOL_MAX_LORA_RANK", "FLUXRL_POOL_MAX_MODEL_LEN"
# Never handed to a pool: it outlives the run that starts it and serves other teams' runs.
# (TICKET: the starting run's ticket is that run's, not the pool's.)
PRIVATE_ENV_PARTS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "TICKET", "DATABASE_URL", "REDIS_URL")


class PoolUnreachable(ConnectionError):
    """A live pool did not take the run's connection within ``FLUXRL_POOL_CONNECT_S`` (its
    entry stays: it is not dead), or a closing one did not exit within it."""



class PoolConfig(wire.Message):
    pool_id: str = Field(pattern=r"^[0-9a-f]{12}-[0-9]+$")
    engine: EngineServerConfig  # lora_rank: the largest adapter rank it serves
    slots: int = Field(4, ge=1, le=64)
    idle_exit_s: float = Field(120.0, ge=0)
    verifier: Optional[str] = Field(None, max_length=4096)  # the platform's public key (PEM): tickets.py



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


def registry_file(pid: str) -> Path:
    return pool_dir() / f"{_registry_name(pid)}.json"


@contextlib.contextmanager
def registry_lock(pid: str):
    with open(pool_dir() / f"{_registry_name(pid)}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read_registry(pid: str) -> Optional[dict]:
    try:
        return json.loads(registry_file(pid).read_text())
    except (OSError, ValueError):
        return None


def write_registry(pool_id: str, info: dict) -> None:
    """Replace the entry whole (a reader never sees half of one). Under the registry lock."""
    path = registry_file(pool_id)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps(info))
    os.replace(staging, path)


def entry_of(info: Optional[dict], owner: dict) -> bool:
    """Whether a registry entry is the one the pool ``owner`` (its pid and nonce) announced."""
    return info is not None and info.get("pid") == owner["pid"] and info.get("nonce") == owner["nonce"]


def process_start(pid: int) -> Optional[int]:
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
        now = process_start(pid)
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
    shared["protocol"] = PROTOCOL_VERSION  # a pool started by older code speaks the older protocol
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
        with registry_lock(pid_):
            info = read_registry(pid_)
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
    write_registry(pid_, {**announced, "started_at": time.time(), "model_path": engine.model_path})
    log.info("started shared engine pool %s (pid %s) at %s", pid_, announced["pid"], announced["address"])
    return announced["address"], int(announced["pid"]), pid_


def forget_pool(pool_id: Optional[str], address: Optional[str]) -> bool:
    """Drop the registry entry that names ``address`` if its process is verifiably gone (a
    pool that cannot be reached but lives keeps it: a second pool beside it would double
    the engine). Whether it was dropped."""
    if pool_id is None:
        return False
    with registry_lock(pool_id):
        info = read_registry(pool_id)
        if info is not None and info.get("address") == address and not pool_alive(info):
            registry_file(pool_id).unlink(missing_ok=True)
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

