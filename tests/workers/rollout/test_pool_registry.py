"""The shared pools' registry (workers/rollout/pool_registry.py) with the real wire and small stand-in
pools, no vLLM: a failed connect is not a dead pool (the run tries again and the live pool
keeps its entry, no second pool is started), and a pool that exits removes only its own
entry."""
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types

import pytest

from workers.io import wire, wire_local
from workers.rollout import pool as pools
from workers.rollout import pool_client, pool_registry
from workers.rollout.messages import (REQUESTS, EngineServerConfig, EngineStats, PingRequest, PongReply, ReadyReply,
                                      StartRequest, TenantInfo)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    folder = tmp_path / "pools"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(pool_registry.DIR_ENV, str(folder))
    monkeypatch.setenv(getattr(pool_registry, "CONNECT_ENV", "FLUXRL_POOL_CONNECT_S"), "20")
    wire_dir = tempfile.mkdtemp(prefix="fw-")
    monkeypatch.setenv(wire_local.LOCAL_DIR_ENV, wire_dir)
    started = []

    def no_second_pool(*args, **kwargs):
        started.append(args)
        raise AssertionError("a second pool was started for a pool id whose pool lives")

    # the pool module's subprocess only (a stand-in pool process is started the real way)
    monkeypatch.setattr(pool_registry, "subprocess", types.SimpleNamespace(Popen=no_second_pool, PIPE=subprocess.PIPE))
    yield started
    for leftover in os.listdir(wire_dir):
        os.unlink(os.path.join(wire_dir, leftover))
    os.rmdir(wire_dir)


@pytest.fixture
def live_process():
    """A process that stands for a live pool's."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _entry(address: str, proc: subprocess.Popen, nonce: str) -> dict:
    start = pool_registry.process_start(proc.pid)
    return {"address": address, "pid": proc.pid, "nonce": nonce, "process_start": start}


def _serve_one(port: int, after_s: float, served: list) -> None:
    """A pool that starts listening only after ``after_s`` (busy, or its handshake slots held)
    and answers a run's start."""
    time.sleep(after_s)
    listener = wire.listen("127.0.0.1", port, key=pool_registry.pool_key())
    try:
        channel = listener.accept(REQUESTS, timeout=20)
        while True:
            request, _ = channel.recv()
            if isinstance(request, StartRequest):
                served.append(request.tenant.run)
                channel.send(ReadyReply(id=request.id, pid=os.getpid(), core_pids=[], worker_count=1,
                                        stats=EngineStats()))
            elif isinstance(request, PingRequest):
                channel.send(PongReply(stats=EngineStats()))
    except (EOFError, OSError, TimeoutError):
        pass
    finally:
        listener.close()


def test_a_failed_connect_keeps_a_live_pools_entry_and_starts_no_second_pool(registry, live_process):
    config = EngineServerConfig(model_path="unused-model", index=0, lora_rank=8)
    pool_id = pool_registry.pool_settings(config, 8)[0]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    entry = _entry(f"127.0.0.1:{port}", live_process, "the live pool")
    pool_registry.registry_file(pool_id).write_text(json.dumps(entry))
    served: list = []
    server = threading.Thread(target=_serve_one, args=(port, 0.7, served), daemon=True)
    server.start()
    client = pool_client.PoolClient(config, TenantInfo(run="run a", team="team a", lora_rank=8))
    try:
        asyncio.run(client.start())
        assert served == ["run a"] and client.address == entry["address"]
    finally:
        client.shutdown()
        server.join(timeout=10)
    assert pool_registry.read_registry(pool_id) == entry  # still the live pool's
    assert registry == []  # and no second pool beside it


def test_a_live_pool_that_never_takes_the_connection_keeps_its_entry(registry, live_process, monkeypatch):
    monkeypatch.setenv(getattr(pool_registry, "CONNECT_ENV", "FLUXRL_POOL_CONNECT_S"), "1")
    config = EngineServerConfig(model_path="unused-model", index=1, lora_rank=8)
    pool_id = pool_registry.pool_settings(config, 8)[0]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    entry = _entry(f"127.0.0.1:{port}", live_process, "the live pool")
    pool_registry.registry_file(pool_id).write_text(json.dumps(entry))
    client = pool_client.PoolClient(config, TenantInfo(run="run a", team="team a", lora_rank=8))
    with pytest.raises(ConnectionError, match="lives but did not take a connection"):
        asyncio.run(client.start())
    assert pool_registry.read_registry(pool_id) == entry and registry == []
    # once its process is gone the entry may go: forget_pool drops only a dead pool's
    assert not pool_registry.forget_pool(pool_id, entry["address"])
    live_process.kill()
    live_process.wait()
    assert pool_registry.forget_pool(pool_id, entry["address"]) and pool_registry.read_registry(pool_id) is None


class _IdleEngine:
    dead = False

    async def start(self):
        pass

    def shutdown(self):
        pass


class _IdlePool:
    """EnginePool without vLLM: nobody joins, so it goes idle at once."""

    def __init__(self, config):
        self.config, self.base, self.tenants = config, _IdleEngine(), {}
        self.connections, self.idle_since = 0, time.monotonic()


def test_a_pool_exiting_removes_only_its_own_registry_entry(registry, live_process, monkeypatch):
    monkeypatch.setattr(pools, "EnginePool", _IdlePool)
    config = pool_registry.PoolConfig(pool_id="0123456789ab-0", engine=EngineServerConfig(model_path="unused", index=0),
                              slots=1, idle_exit_s=0)
    other = _entry("127.0.0.1:1", live_process, "another pool")

    def announce(announced):
        # meanwhile a run found this pool unreachable and another pool took the id
        pool_registry.registry_file(config.pool_id).write_text(json.dumps(other))

    asyncio.run(pools._serve(config, announce))
    assert pool_registry.read_registry(config.pool_id) == other

    # its own entry: "closing" while it shuts down, gone once it has
    def announce_own(announced):
        pool_registry.registry_file(config.pool_id).write_text(json.dumps({**announced, "started_at": 0}))

    asyncio.run(pools._serve(config, announce_own))
    assert pool_registry.read_registry(config.pool_id) is None


def test_a_pool_is_found_only_by_runs_of_its_protocol_version(tmp_path, monkeypatch):
    """A pool outlives the runs that started it: one started by code of another protocol
    version (an older message shape) is not the pool a newer run joins."""
    from workers.rollout import messages

    config = EngineServerConfig(model_path=str(tmp_path), index=0, max_model_len=256)
    now = pool_registry.pool_settings(config, 8)[0]
    monkeypatch.setattr(pool_registry, "PROTOCOL_VERSION", messages.PROTOCOL_VERSION - 1)
    assert pool_registry.pool_settings(config, 8)[0] != now
