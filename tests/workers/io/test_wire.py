"""The run's wire (workers/io/wire.py) under a hostile network, with real sockets and processes:
mutual TLS 1.3 keyed by the run's cluster key, a handshake deadline per connection, a
connect timeout, capped frames, and readers (node.py, engine_server.py) that fail the run
instead of hanging; plus the node agent's path confinement and the engine server's
environment allow-list."""
import asyncio
import os
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError

from workers.io import wire, wire_local
from workers.rollout.client import EngineClient
from workers.rollout.messages import REQUESTS, EngineServerConfig, StartRequest
from workers.cluster.node import (TO_NODE, Cluster, Join, NodeError, PathRefused, TrainerCall, _call_group,
                          confined)
from workers.rollout.engine_types import EngineDied

ROOT = Path(__file__).resolve().parents[3]
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


class Note(wire.Message):
    text: str
    n: int = 0


NOTES = TypeAdapter(Note)


@pytest.fixture
def fast_deadline(monkeypatch):
    monkeypatch.setenv(wire.HANDSHAKE_ENV, "1")
    return 1.0


@pytest.fixture
def listener():
    lst = wire.listen("127.0.0.1", 0, key=KEY)
    yield lst
    lst.close()


def _pair(listener, key=KEY):
    client = wire.connect(listener.address, NOTES, key=key)
    server = listener.accept(NOTES, timeout=5)
    return client, server


def _raw_frame(size: int, kind: bytes = b"M") -> bytes:
    return struct.pack(">IB", size, kind[0])


def _send_raw(channel: wire.Channel, data: bytes) -> None:
    """What a key holder that does not follow the protocol could send."""
    with channel.tls._send:
        channel.tls.write(data)


# -- the handshake ----------------------------------------------------------------------------
def test_engine_launches_from_two_threads_at_once_share_one_new_cluster_key(monkeypatch):
    # The coordinator launches its engine servers from threads together. Making a key
    # releases the interpreter lock (os.urandom), so unguarded each thread could make its
    # own (seen: a run whose engine refused the coordinator's certificate). The window is
    # widened here to 20 ms so that an unguarded key fails every time.
    token_hex = wire.secrets.token_hex

    def slow_token_hex(n):
        time.sleep(0.02)
        return token_hex(n)

    monkeypatch.setattr(wire.secrets, "token_hex", slow_token_hex)
    monkeypatch.delenv(wire.KEY_ENV, raising=False)
    start, keys = threading.Barrier(2), []

    def launch():
        start.wait()
        keys.append(wire.cluster_key())

    threads = [threading.Thread(target=launch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert keys[0] == keys[1] == bytes.fromhex(os.environ[wire.KEY_ENV])


def test_messages_and_blobs_cross_between_two_processes_holding_the_key(listener):
    """Every process derives the same certificate authority from the key: a child process
    (its own interpreter) connects, and a message and a blob go both ways."""
    script = ("import sys; from pydantic import TypeAdapter; from workers.io import wire\n"
              "class Note(wire.Message):\n text: str\n n: int = 0\n"
              f"c = wire.connect(('127.0.0.1', {listener.address[1]}), TypeAdapter(Note))\n"
              "m, blob = c.recv(); c.send(Note(text=m.text[::-1], n=len(blob)), blob[::-1]); c.recv()\n")
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT,
                             env={**os.environ, wire.KEY_ENV: KEY.hex()})
    try:
        server = listener.accept(NOTES, timeout=60)
        blob = os.urandom(3 << 20)
        server.send(Note(text="hello"), blob)
        reply, back = server.recv()
        assert reply == Note(text="olleh", n=3 << 20) and back == blob[::-1]
        server.close()
        assert child.wait(timeout=30) != 0  # its last recv saw the channel close
    finally:
        child.kill()


def test_a_closed_listeners_port_can_be_bound_again_at_once():
    # a resumed run binds its rendezvous anew right after the first run closed it; the accept
    # thread's poll must not keep the socket listening for up to half a second
    for _ in range(5):
        first = wire.listen("127.0.0.1", 0, key=KEY)
        time.sleep(0.1)  # the accept thread is in its poll
        first.close()
        again = wire.listen("127.0.0.1", first.address[1], key=KEY)
        again.close()


def test_a_client_with_another_runs_key_is_refused_and_the_listener_serves_on(listener):
    with pytest.raises(wire.KeyRefused):
        wire.connect(listener.address, NOTES, key=OTHER_KEY)
    with pytest.raises(TimeoutError):  # nothing was handed to the application
        listener.accept(NOTES, timeout=0.5)
    client, server = _pair(listener)
    client.send(Note(text="still here"))
    assert server.recv()[0].text == "still here"


def test_a_tls_client_without_a_certificate_is_refused(listener):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(listener.address, timeout=5) as raw, ctx.wrap_socket(raw) as tls:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            tls.sendall(_raw_frame(20) + b'{"text": "forged"}  ')
            tls.recv(1)  # the server's alert: a certificate is required
    with pytest.raises(TimeoutError):
        listener.accept(NOTES, timeout=0.5)


def test_a_silent_connection_is_dropped_at_the_deadline_and_does_not_delay_a_real_client(fast_deadline, listener):
    silent = socket.create_connection(listener.address)
    time.sleep(0.1)  # the listener has taken it and is waiting for its handshake
    started = time.monotonic()
    client, server = _pair(listener)
    assert time.monotonic() - started < 0.5 * fast_deadline  # not behind the silent one
    client.send(Note(text="through"))
    assert server.recv()[0].text == "through"
    silent.settimeout(5)
    assert silent.recv(1) == b""  # closed by the listener ...
    assert time.monotonic() - started < fast_deadline + 1.0  # ... at its deadline
    silent.close()


@pytest.fixture
def flood_deadline(monkeypatch):
    """Long enough to open a flood of connections on a loaded machine, short enough to wait out."""
    monkeypatch.setenv(wire.HANDSHAKE_ENV, "3")
    return 3.0


def _silent_from(source: str, port: int, count: int) -> list[socket.socket]:
    """``count`` TCP connections from ``source`` (any of 127.0.0.0/8 on Linux: a stranger on
    another address) that never say a word."""
    socks = []
    for i in range(count):
        if i % 8 == 7:
            time.sleep(0.02)  # within the listen backlog: a refused SYN would come back a second later
        sock = socket.socket()
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
        socks.append(sock)
    return socks


def _closed_by(socks: list[socket.socket], deadline: float) -> bool:
    """Whether the listener closed every one of them by ``deadline`` (monotonic)."""
    for sock in socks:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if sock.recv(1) != b"":
                return False
        except socket.timeout:
            return False
        except ConnectionResetError:
            pass
    return True


def test_silent_connections_from_one_address_take_a_few_slots_and_close_at_the_deadline(flood_deadline, listener):
    fast_deadline = flood_deadline
    opened = time.monotonic()
    silent = _silent_from("127.0.0.2", listener.address[1], wire._MAX_HANDSHAKES + 16)
    time.sleep(0.2)  # the listener has taken them all
    assert time.monotonic() - opened < 0.8 * fast_deadline  # all still within their handshake deadline
    started = time.monotonic()
    client, server = _pair(listener)  # a first-time peer on another address gets a slot at once
    assert time.monotonic() - started < 0.5 * fast_deadline
    client.send(Note(text="through"))
    assert server.recv()[0].text == "through"
    try:
        assert _closed_by(silent, started + fast_deadline + 1.0)  # the extra ones at once, the rest at the deadline
    finally:
        for sock in silent:
            sock.close()


def test_strangers_on_many_addresses_holding_every_slot_do_not_stop_a_known_peer(flood_deadline, listener):
    fast_deadline = flood_deadline
    first, _ = _pair(listener)  # 127.0.0.1 is a known peer from here on
    first.close()
    port = listener.address[1]
    per_address = wire._MAX_HANDSHAKES_PER_STRANGER
    addresses = [f"127.0.1.{i}" for i in range(1, wire._MAX_HANDSHAKES // per_address + 3)]
    opened = time.monotonic()
    silent = [s for a in addresses for s in _silent_from(a, port, per_address)]
    time.sleep(0.2)  # every slot is a stranger's
    assert time.monotonic() - opened < 0.5 * fast_deadline  # all still within their handshake deadline
    assert len(silent) > wire._MAX_HANDSHAKES
    for _ in range(3):  # and again, as they are reopened: the known peer is served each time
        started = time.monotonic()
        client, server = _pair(listener)
        assert time.monotonic() - started < 0.5 * fast_deadline
        client.send(Note(text="known"))
        assert server.recv()[0].text == "known"
        client.close()
        server.close()
    for sock in silent:
        sock.close()


@pytest.fixture
def local_wire(monkeypatch):
    """A folder of local sockets of this test's own (short: a socket's path is)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="fw-")
    monkeypatch.setenv(wire_local.LOCAL_DIR_ENV, folder)
    yield Path(folder)
    for leftover in Path(folder).iterdir():
        leftover.unlink()
    os.rmdir(folder)


def _silent_local(path: str, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        socks.append(sock)
    return socks


def test_silent_local_connections_do_not_stop_a_real_local_client(flood_deadline, local_wire):
    """On one node every TCP peer is 127.0.0.1: 80 silent connections from there (any local
    user can open them) once failed the run's own clients at once. This user's processes
    connect over the listener's local socket, where slots go by process; even 80 silent
    ones there, from the client's own process, give way to its real handshake."""
    lst = wire.listen("127.0.0.1", 0, key=KEY)
    try:
        silent = _silent_from("127.0.0.1", lst.address[1], 80)
        local_path = getattr(lst, "local_path", None)
        assert local_path is not None or not hasattr(wire, "_open_local")  # (the wire had none)
        if local_path is not None:
            silent += _silent_local(local_path, 80)
        time.sleep(0.2)  # the listener has taken them all
        started = time.monotonic()
        client, server = _pair(lst)
        assert time.monotonic() - started < 0.5 * flood_deadline
        client.send(Note(text="through"))
        assert server.recv()[0].text == "through"
        assert client.peer.endswith("(local socket)") and server.peer.startswith("local pid ")
        assert int(server.peer.rsplit(" ", 1)[1]) == os.getpid()  # the kernel's word, not the peer's
        assert oct(local_wire.stat().st_mode & 0o777) == "0o700" and oct(os.stat(lst.local_path).st_mode & 0o777) == "0o600"
        assert _closed_by(silent, started + flood_deadline + 1.0)
        for sock in silent:
            sock.close()
    finally:
        lst.close()
    assert not any(local_wire.iterdir())  # the socket went with its listener


def test_silent_connections_from_a_known_address_push_out_each_other_not_its_real_peers(flood_deadline, monkeypatch):
    monkeypatch.setenv(wire_local.LOCAL_ENV, "0")  # TCP only: 127.0.0.1 is one source for everyone on the node
    lst = wire.listen("127.0.0.1", 0, key=KEY)
    try:
        first, _ = _pair(lst)  # 127.0.0.1 is a known peer from here on
        first.close()
        silent = _silent_from("127.0.0.1", lst.address[1], 80)
        time.sleep(0.2)
        started = time.monotonic()
        client, server = _pair(lst)
        assert time.monotonic() - started < 0.5 * flood_deadline
        assert not client.peer.endswith("(local socket)")
        client.send(Note(text="known"))
        assert server.recv()[0].text == "known"
        assert _closed_by(silent, started + flood_deadline + 1.0)
        for sock in silent:
            sock.close()
    finally:
        lst.close()


def test_a_local_folder_open_to_others_or_a_stale_socket_leaves_the_client_on_tcp(local_wire):
    lst = wire.listen("127.0.0.1", 0, key=KEY)
    try:
        assert lst.local_path is not None
        local_wire.chmod(0o755)
        client, server = _pair(lst)
        assert not client.peer.endswith("(local socket)") and not server.peer.startswith("local")
        local_wire.chmod(0o700)
        client, server = _pair(lst)
        assert client.peer.endswith("(local socket)")
    finally:
        lst.close()
    # a listener that died without removing its socket: nobody answers there, TCP does
    port = lst.address[1]
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(lst.local_path)
    stale.close()
    again = wire.listen("127.0.0.1", port, key=KEY, local=False)
    try:
        client, _ = _pair(again)
        assert not client.peer.endswith("(local socket)")
    finally:
        again.close()
        os.unlink(lst.local_path)


def test_connect_gives_up_on_a_server_that_never_answers(fast_deadline):
    with socket.create_server(("127.0.0.1", 0)) as mute:  # the kernel completes TCP; nobody speaks
        started = time.monotonic()
        with pytest.raises(wire.HandshakeFailed):
            wire.connect(mute.getsockname(), NOTES, key=KEY)
        assert fast_deadline <= time.monotonic() - started < fast_deadline + 1.0


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]"])
def test_a_wildcard_rendezvous_is_refused_before_it_listens(host, monkeypatch):
    """Its host becomes the trainer world's master address on every node: a wildcard would
    send them to their own loopback."""
    from workers.cluster.node import Cluster

    monkeypatch.setenv(wire.KEY_ENV, KEY.hex())
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ValueError, match=r"names no host the other nodes can reach; give node 0's own address"):
        Cluster(f"{host}:{port}", 2, 5.0)
    with socket.create_server(("127.0.0.1", port)):  # nothing took the port
        pass


def test_the_rendezvous_serves_agents_past_a_silent_connection(fast_deadline, monkeypatch):
    from workers.cluster.node import _connect

    monkeypatch.setenv(wire.KEY_ENV, KEY.hex())
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("cluster", Cluster(f"127.0.0.1:{port}", 2, 20.0)))
    thread.start()
    silent = None
    for _ in range(100):
        try:
            silent = socket.create_connection(("127.0.0.1", port))
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    started = time.monotonic()
    agent = [_connect(("127.0.0.1", port), Join(node_rank=1, channel=c, host="127.0.0.1", pid=os.getpid()))
             for c in ("control", "watch")]
    thread.join(timeout=10)
    assert "cluster" in result and time.monotonic() - started < 0.5 * fast_deadline
    result["cluster"].close()
    assert isinstance(agent[0].recv()[0], type(TO_NODE.validate_python({"kind": "shutdown"})))
    silent.close()


# -- frames on the stream ------------------------------------------------------------------------
class _Proxy:
    """A TCP relay between client and server that can alter the client's next bytes."""

    def __init__(self, target):
        self.target = target
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self.tamper = None  # bytes -> bytes, applied once to the next client->server chunk
        self.tampered = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        down, _ = self.sock.accept()
        up = socket.create_connection(self.target)
        threading.Thread(target=self._pump, args=(up, down, False), daemon=True).start()
        self._pump(down, up, True)

    def _pump(self, src, dst, from_client):
        try:
            while data := src.recv(65536):
                if from_client and self.tamper is not None:
                    data, self.tamper = self.tamper(data), None
                    self.tampered.set()
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _flip_one_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1:]


def _inject_a_cleartext_frame(data: bytes) -> bytes:
    forged = b'{"text": "forged", "n": 666}'
    return data + _raw_frame(len(forged)) + forged


@pytest.mark.parametrize("tamper", [_flip_one_byte, _inject_a_cleartext_frame])
def test_bytes_altered_on_the_stream_fail_the_receiver_and_deliver_nothing(listener, tamper):
    proxy = _Proxy(listener.address)
    client = wire.connect(proxy.address, NOTES, key=KEY)
    server = listener.accept(NOTES, timeout=5)
    client.send(Note(text="genuine", n=1))
    assert server.recv()[0] == Note(text="genuine", n=1)
    proxy.tamper = tamper
    client.send(Note(text="genuine", n=2))
    assert proxy.tampered.wait(5)
    delivered = []
    with pytest.raises((wire.WireError, EOFError)) as failure:
        while True:
            delivered.append(server.recv()[0])
    # a flipped byte fails the record's authentication; injected cleartext is no TLS record
    assert isinstance(failure.value, wire.WireError) and "TLS" in str(failure.value), failure.value
    assert all(m.text == "genuine" for m in delivered) and not any(m.n == 666 for m in delivered)
    assert delivered in ([], [Note(text="genuine", n=2)])  # only the injection may follow a whole record
    assert server.tls.closed
    with pytest.raises((EOFError, OSError)):  # the sender sees the connection end too
        client.send(Note(text="after"))
        client.recv()


@pytest.mark.parametrize("what", ["header", "blob"])
def test_an_oversized_length_prefix_is_refused_without_allocating(listener, monkeypatch, what):
    monkeypatch.setenv(wire.MAX_BLOB_ENV, "1")  # 1 MiB blobs at most
    client, server = _pair(listener)
    if what == "header":
        _send_raw(client, _raw_frame(0xFFFFFFF0))  # 4 GiB of JSON announced
    else:
        body = b'{"text": "big"}'
        _send_raw(client, _raw_frame(len(body), b"B") + body + struct.pack(">Q", 1 << 40))  # a 1 TiB blob
    tracemalloc.start()
    try:
        started = time.monotonic()
        with pytest.raises(wire.FrameTooLarge, match="over"):
            server.recv()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 512 * 1024, peak  # one socket read (256 KiB), not the gigabytes announced
    assert time.monotonic() - started < 1.0 and server.tls.closed
    with pytest.raises(EOFError):  # the peer is cut off
        client.recv()


def test_an_oversized_blob_is_refused_before_sending_and_the_channel_stays_usable(listener, monkeypatch):
    monkeypatch.setenv(wire.MAX_BLOB_ENV, "1")
    client, server = _pair(listener)
    with pytest.raises(wire.FrameTooLarge):
        client.send(Note(text="weights"), bytes((1 << 20) + 1))
    # from a thread: a local socket may buffer less than the blob (net.core.wmem_max)
    sender = threading.Thread(target=client.send, args=(Note(text="small"), bytes(1 << 20)))
    sender.start()
    message, blob = server.recv()
    sender.join()
    assert message.text == "small" and len(blob) == 1 << 20


def test_a_message_that_does_not_validate_closes_the_channel_with_a_named_error(listener):
    client, server = _pair(listener)
    body = b'{"text": 1, "unknown": true}'
    _send_raw(client, _raw_frame(len(body)) + body)
    with pytest.raises(wire.BadFrame, match="invalid message"):
        server.recv()
    assert server.tls.closed


# -- readers that fail the run -------------------------------------------------------------------
def test_an_engine_clients_pending_call_fails_with_the_named_error_of_a_bad_frame(monkeypatch):
    """The client's reader thread ends on any failure and the pending start fails at once
    (before, a frame that did not validate killed the thread and the call waited forever)."""
    monkeypatch.setenv(wire.KEY_ENV, KEY.hex())
    lst = wire.listen("127.0.0.1", 0)
    client = EngineClient(EngineServerConfig(model_path="unused", index=7),
                          address=wire.format_address(lst.address), pid=0)

    def rogue_server():
        channel = lst.accept(REQUESTS, timeout=10)
        request, _ = channel.recv()
        assert isinstance(request, StartRequest)
        _send_raw(channel, _raw_frame(0xFFFFFFF0))

    rogue = threading.Thread(target=rogue_server, daemon=True)
    rogue.start()
    loop = asyncio.new_event_loop()
    try:
        started = time.monotonic()
        with pytest.raises(EngineDied, match="FrameTooLarge"):
            loop.run_until_complete(asyncio.wait_for(client.start(), 10))
        assert time.monotonic() - started < 5
    finally:
        client._closing = True
        loop.close()
        lst.close()


def test_a_bad_frame_from_a_node_agent_fails_the_coordinators_call(monkeypatch):
    monkeypatch.setenv(wire.KEY_ENV, KEY.hex())
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("cluster", Cluster(f"127.0.0.1:{port}", 2, 20.0)))
    thread.start()
    from workers.cluster.node import _connect

    control, watch = [_connect(("127.0.0.1", port), Join(node_rank=1, channel=c, host="127.0.0.1", pid=1))
                      for c in ("control", "watch")]
    thread.join(timeout=10)
    cluster = result["cluster"]
    try:
        call = cluster.new_call("begin_step")
        cluster.send_call(call)
        assert control.recv()[0] == call
        body = b'{"kind": "called", "id": "not a number"}'
        _send_raw(control, _raw_frame(len(body)) + body)
        with pytest.raises(NodeError, match="BadFrame"):
            cluster.gather_call(call)
    finally:
        cluster.close()
        watch.close()
        control.close()


# -- what a key holder may not do ------------------------------------------------------------------
class _Recorder:
    """Stands in for the node's TrainerGroup: records what it was asked to do."""

    def __init__(self):
        self.calls = []

    def save(self, path):
        self.calls.append(("save", path))

    def load_state(self, path):
        self.calls.append(("load_state", path))


@pytest.mark.parametrize("path", ["/etc/cron.d/x", "../outside", "checkpoints/../../outside", "link/inside"])
def test_a_trainer_path_outside_the_run_folder_is_refused(tmp_path, path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "link").symlink_to(tmp_path)  # a symlink that leads out of the run's folder
    group = _Recorder()
    for method in ("save", "load_state"):
        with pytest.raises(PathRefused, match="outside the run's folder"):
            _call_group(group, TrainerCall(id=1, method=method, path=path), str(run))
    assert group.calls == []
    _call_group(group, TrainerCall(id=2, method="save", path=str(run / "checkpoints" / ".tmp-3" / "model")), str(run))
    assert group.calls == [("save", str(run.resolve() / "checkpoints" / ".tmp-3" / "model"))]


def test_an_agent_without_a_run_folder_refuses_every_path(tmp_path):
    with pytest.raises(PathRefused, match="no run folder"):
        confined(str(tmp_path / "x"), "")


@pytest.mark.parametrize("key", ["LD_PRELOAD", "PYTHONPATH", "VLLM_PLUGINS", "CUDA_VISIBLE_DEVICES_X", "PATH"])
def test_an_engine_server_environment_outside_the_allow_list_is_refused(key):
    with pytest.raises(ValidationError, match=f"may not set {key}"):
        EngineServerConfig(model_path="m", index=0, env={key: "x", "OMP_NUM_THREADS": "2"})
    # nor does it pass inside a node's assignment
    config = EngineServerConfig(model_path="m", index=0).model_dump()
    config["env"] = {key: "x"}
    with pytest.raises(ValidationError, match=f"may not set {key}"):
        TypeAdapter(EngineServerConfig).validate_python(config)


def test_the_environment_the_plan_sets_is_allowed():
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "OMP_NUM_THREADS": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-3",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert EngineServerConfig(model_path="m", index=0, env=env).env == env
