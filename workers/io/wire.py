"""Typed messages between the run's processes over mutually authenticated TLS 1.3.

Roles on different processes (and nodes) talk over TCP wrapped in TLS 1.3 (Python's
``ssl``; no cryptography of our own). The run's cluster key (``FLUXRL_CLUSTER_KEY``) is
the only secret: every process derives from it the same certificate authority — an
Ed25519 key and a self-signed certificate with fixed fields (workers/io/wire_tls.py) — both
ends present that certificate and require the peer's to chain to it. So:

* Without the key, a host on the network can neither connect (the handshake fails), nor
  read (frames are encrypted: weights, spec, samples), nor alter, inject or replay frames
  (each TLS record is authenticated; a changed byte fails the connection, never delivers
  a forged message). It can still drop or delay connections — which the callers notice
  (timeouts, heartbeats) and turn into a failed run — and see the traffic's size and timing.
* A key holder is a member of the run, with the rights the protocol gives members: it can
  join as a node agent (and receive the spec and the weights), or connect to an engine
  server and drive it. It can not make a process run code of its choosing through the wire:
  messages are pydantic JSON, never pickles; trainer load/save paths are confined to the
  run's folder (workers/cluster/node.py) and an engine server's environment to an allow-list
  (workers/rollout/messages.py). Anyone who can read a run process's environment has the key.
* Not covered: torch.distributed traffic (the trainer world, the collective weight
  broadcast) goes over its own sockets, unencrypted; keep the cluster network private.

Every accepted connection must finish its handshake within ``FLUXRL_WIRE_HANDSHAKE_S``
(default 10 s), each in a thread of its own so a silent connection never blocks others;
connects have the same limit. Handshake slots are shared out by who connects: at most 64 at
once, at most 8 per source that has never completed a handshake here (a stranger; 16 for a
known peer). A source past its cap does not lock anyone out: its newest connection pushes
out its own oldest pending one (a real peer's handshake takes milliseconds; one that waits
is most likely silent), and when all 64 are taken a newcomer pushes out the stranger's
handshake that has waited longest (else the oldest of the source holding most slots).

**The local wire.** On one node every TCP peer is 127.0.0.1, so a TCP source says nothing
about who connects. Each listener therefore also listens on a Unix-domain socket in this
user's folder ``FLUXRL_WIRE_DIR`` (default ``$TMPDIR/fluxrl-wire-<uid>``, mode 700, checked to
be this user's), named by the TCP address it stands for and this network namespace; a
client of this host that dials that address uses it instead (:func:`connect`). The kernel
names the peer (``SO_PEERCRED``): the listener accepts only this user's processes and
counts handshake slots per connecting process, and the client accepts only a listener of
this user; TLS with the key, the deadlines and the size caps are the same as over TCP.
``FLUXRL_WIRE_LOCAL=0`` turns it off (TCP only).

A frame's length is checked before anything is allocated:
a header over 1 MiB or a blob over ``FLUXRL_WIRE_MAX_BLOB_MB`` (default 4096) closes the
connection with :class:`FrameTooLarge`. Any failure of a channel (EOF, TLS error, bad or
oversized frame, a message that does not validate) closes it and raises ``EOFError`` or
an ``OSError`` (:class:`WireError`), so callers' reader threads end the same way for all.
"""
from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import os
import queue
import secrets
import socket
import ssl
import struct
import threading
import time
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from workers.io.wire_local import (LOCAL_DIR_ENV, UNIX_PATH_MAX, local_dir, local_enabled, local_name, net_namespace,
                                   open_local, peer_credentials)
from workers.io.wire_tls import (BadFrame as BadFrame, FrameTooLarge as FrameTooLarge,
                                 HandshakeFailed as HandshakeFailed, KeyRefused as KeyRefused, Tls,
                                 WireError as WireError, format_address as format_address,
                                 parse_address as parse_address, read_exact, tls_context)

log = logging.getLogger(__name__)

KEY_ENV = "FLUXRL_CLUSTER_KEY"  # hex; every process of a run must have the same
HANDSHAKE_ENV = "FLUXRL_WIRE_HANDSHAKE_S"
MAX_BLOB_ENV = "FLUXRL_WIRE_MAX_BLOB_MB"
MAX_HEADER = 1 << 20  # a message's JSON: samples of a batch fit many times over
_MAX_HANDSHAKES = 64  # connections handshaking at once per listener
# Per source (a TCP address, or a local process): one that never completed a handshake on
# this listener (a stranger) holds a few slots at most; a known peer's address (a whole
# node: its agent's two channels, the engine clients) a few more. Past its cap a source's
# newest connection pushes out its own oldest, so no source can lock the others out, nor
# its own real peers (a dropped node agent retries: cluster/node.py).
_MAX_HANDSHAKES_PER_STRANGER = 8
_MAX_HANDSHAKES_PER_KNOWN = 16
_WELCOME = b"\x01"  # the server's first byte: it accepted our certificate

_HEAD = struct.Struct(">IB")  # JSON length, kind (M: message, B: message + blob)
_BLOB = struct.Struct(">Q")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_KEY_LOCK = threading.Lock()


def cluster_key() -> bytes:
    """The run's key from the environment, or a new one (set in the environment so the
    processes this one starts inherit it). Under a lock: engine servers launch from
    several threads at once, and two new keys would split the run in two."""
    with _KEY_LOCK:
        value = os.environ.get(KEY_ENV)
        if not value:
            value = secrets.token_hex(32)
            os.environ[KEY_ENV] = value
    return bytes.fromhex(value)


def shared_key() -> bytes:
    """The key processes on several nodes share: it must come from the environment."""
    if not os.environ.get(KEY_ENV):
        raise ValueError(f"a run over several nodes needs the same {KEY_ENV} on every node, e.g. export "
                         f"{KEY_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))')")
    return cluster_key()


def handshake_timeout() -> float:
    return float(os.environ.get(HANDSHAKE_ENV, "10"))


def max_blob_bytes() -> int:
    return int(float(os.environ.get(MAX_BLOB_ENV, "4096")) * (1 << 20))


class Channel:
    """One end of a connection: ``send`` from any thread, ``recv`` from one."""

    def __init__(self, tls: Tls, messages: TypeAdapter[Any], peer: str = ""):
        self.tls = tls
        self.messages = messages
        self.peer = peer

    def send(self, message: BaseModel, blob: Optional[bytes] = None) -> None:
        header = message.model_dump_json().encode()
        if len(header) > MAX_HEADER:  # refused here, before a byte goes out: the stream stays whole
            raise FrameTooLarge(f"a {type(message).__name__} of {len(header)} bytes is over the {MAX_HEADER}-byte "
                                "message cap")
        if blob is not None and len(blob) > max_blob_bytes():
            raise FrameTooLarge(f"a blob of {len(blob)} bytes is over {MAX_BLOB_ENV} ({max_blob_bytes()} bytes)")
        head = _HEAD.pack(len(header), ord("B") if blob is not None else ord("M")) + header
        if blob is not None:
            head += _BLOB.pack(len(blob))
        if self.tls.closed:
            raise WireError("the channel is closed")
        with self.tls._send:  # noqa: SLF001 - the frame and its blob in one piece
            self.tls.write(head)
            if blob is not None:
                self.tls.write(blob)

    def recv(self) -> tuple[Any, Optional[bytes]]:
        """(message, blob or None). Raises EOFError when the peer is gone, or a
        :class:`WireError` (an ``OSError``) for anything else; either way the channel is closed."""
        try:
            size, kind = _HEAD.unpack(read_exact(self.tls, _HEAD.size))
            if kind not in (ord("M"), ord("B")):
                raise BadFrame(f"a frame of unknown kind {kind} from {self.peer}")
            if size > MAX_HEADER:
                raise FrameTooLarge(f"a message of {size} bytes announced by {self.peer}, over the {MAX_HEADER}-byte cap")
            body = read_exact(self.tls, size)
            blob = None
            if kind == ord("B"):
                (blob_size,) = _BLOB.unpack(read_exact(self.tls, _BLOB.size))
                if blob_size > max_blob_bytes():
                    raise FrameTooLarge(f"a blob of {blob_size} bytes announced by {self.peer}, over {MAX_BLOB_ENV} "
                                        f"({max_blob_bytes()} bytes)")
                blob = bytes(read_exact(self.tls, blob_size))
            try:
                return self.messages.validate_json(body), blob
            except ValidationError as exc:
                raise BadFrame(f"an invalid message from {self.peer}: {exc}") from None
        except EOFError:
            self.close()
            raise
        except ssl.SSLError as exc:  # a record that fails its authentication tag lands here
            self.close()
            raise WireError(f"TLS error on the connection with {self.peer}: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def poll(self, timeout: float) -> bool:
        if self.tls.closed:
            return True  # recv says why
        try:
            return self.tls.readable(timeout)
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        if not self.tls.closed:
            self.tls.close()


def _tune(sock: socket.socket) -> None:
    if sock.family == socket.AF_UNIX:  # a local peer: its process ending closes the socket
        # as much in flight as loopback TCP allows (the kernel caps it at net.core.wmem_max)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # a peer whose machine vanished (no FIN, no RST) fails the connection in about a minute
    # instead of leaving a reader waiting forever
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _server_side(sock: socket.socket, key: bytes, deadline: float) -> Tls:
    tls = Tls(sock, tls_context(key, server=True), server=True)
    try:
        _tune(sock)
        tls.handshake(deadline)
        with tls._send:  # noqa: SLF001
            tls.write(_WELCOME)
        sock.settimeout(None)
    except BaseException:
        tls.close()
        raise
    return tls


class _Pending:
    """A connection handshaking in its own thread; ``source``: who connects (a TCP address,
    or a local process)."""

    __slots__ = ("sock", "source", "known", "evicted")

    def __init__(self, sock: socket.socket, source: str, known: bool):
        self.sock, self.source, self.known, self.evicted = sock, source, known, False


class Listener:
    """Accepts connections on ``(host, port)``, and from this user's processes on this host on
    a local socket too (``local``; see the module's docstring); each handshakes in a thread
    of its own within the deadline, so a silent or hostile connection delays nobody, and
    handshake slots are shared out by source."""

    def __init__(self, host: str, port: int = 0, key: Optional[bytes] = None, local: bool = True):
        self.key = key or cluster_key()
        self._sock = socket.create_server((host, port), backlog=64)
        self._sock.settimeout(0.5)  # the accept loop looks at _closed this often
        self.address = self._sock.getsockname()[:2]
        self._ready: queue.Queue[tuple[Tls, str]] = queue.Queue()
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []  # oldest first
        self._known: set[str] = set()  # sources that completed a handshake (only key holders can)
        self._dropped = 0
        self._dropped_logged_at = 0.0
        self._closed = False
        self._local: Optional[socket.socket] = None
        self.local_path: Optional[str] = None
        self._local_ino = 0
        if local and local_enabled():
            try:
                self._listen_local()
            except BaseException:
                self._sock.close()
                raise
        self._acceptors = [threading.Thread(target=self._accept_loop, args=(self._sock,),
                                            name=f"wire-accept-{self.address[1]}", daemon=True)]
        if self._local is not None:
            self._acceptors.append(threading.Thread(target=self._accept_loop, args=(self._local,),
                                                    name=f"wire-accept-local-{self.address[1]}", daemon=True))
        for thread in self._acceptors:
            thread.start()

    def _listen_local(self) -> None:
        """The local socket that stands for this listener's address. Bound under a name of its
        own and renamed into place, so a stale socket of a process that died on this port is
        replaced at once and a client never finds a half-made one."""
        folder = local_dir(create=True)
        if folder is None or net_namespace() == 0:
            return
        path = folder / local_name(ipaddress.ip_address(self.address[0].strip("[]")).compressed, self.address[1])
        staging = folder / f".{secrets.token_hex(8)}.sock"
        if len(str(staging).encode()) > UNIX_PATH_MAX:
            log.warning("wire %s: no local socket: %s is too long a path for one (set %s to a shorter folder)",
                        format_address(self.address), folder, LOCAL_DIR_ENV)
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(staging))
            os.chmod(staging, 0o600)
            sock.listen(64)
            os.replace(staging, path)
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(staging)
            raise
        sock.settimeout(0.5)
        self._local, self.local_path, self._local_ino = sock, str(path), os.stat(path).st_ino

    def _accept_loop(self, listening: socket.socket) -> None:
        local = listening.family == socket.AF_UNIX
        while not self._closed:
            try:
                sock, peer = listening.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._closed:
                    return
                time.sleep(0.1)  # e.g. out of file descriptors: try again
                continue
            if local:
                pid, uid, _ = peer_credentials(sock)
                if uid != os.getuid():  # the folder is closed to others; this holds if it is opened
                    self._note_drop(f"local uid {uid} (not this user)")
                    sock.close()
                    continue
                source = f"local pid {pid}"
            else:
                source = str(peer[0])
            name = source if local else format_address(peer)
            pending = self._admit(sock, source)
            if pending is None:
                self._note_drop(name)
                sock.close()
                continue
            threading.Thread(target=self._handshake, args=(pending, name), name="wire-handshake", daemon=True).start()

    def _admit(self, sock: socket.socket, source: str) -> Optional[_Pending]:
        """A slot for a new connection from ``source``, or None (dropped). A source at its cap
        gives up its own oldest pending handshake; over the global cap the newcomer takes the
        slot of the stranger that has handshaken longest, else of the oldest of the source
        holding most slots (a real peer's handshake takes milliseconds; one that waits is
        most likely silent)."""
        with self._lock:
            known = source in self._known
            same = [p for p in self._pending if p.source == source]
            victim = None
            if len(same) >= (_MAX_HANDSHAKES_PER_KNOWN if known else _MAX_HANDSHAKES_PER_STRANGER):
                victim = same[0]
            elif len(self._pending) >= _MAX_HANDSHAKES:
                victim = next((p for p in self._pending if not p.known), None)
                if victim is None:
                    counts = collections.Counter(p.source for p in self._pending)
                    biggest = max(counts, key=counts.__getitem__)
                    if counts[biggest] <= len(same):  # the newcomer's source holds as many: it waits (retries)
                        return None
                    victim = next(p for p in self._pending if p.source == biggest)
            if victim is not None:
                self._pending.remove(victim)
                victim.evicted = True
                try:  # wakes its thread, which closes it
                    victim.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            pending = _Pending(sock, source, known)
            self._pending.append(pending)
            return pending

    def _note_drop(self, peer: str) -> None:
        # one line a second at most: a flood must not flood the log too
        with self._lock:
            self._dropped += 1
            now = time.monotonic()
            if now - self._dropped_logged_at < 1.0:
                return
            dropped, self._dropped, self._dropped_logged_at = self._dropped, 0, now
        log.warning("wire %s: handshake slots taken (%d at most, %d per unknown source); dropped or pushed out %d "
                    "connection(s), the last from %s", format_address(self.address), _MAX_HANDSHAKES,
                    _MAX_HANDSHAKES_PER_STRANGER, dropped, peer)

    def _handshake(self, pending: _Pending, peer: str) -> None:
        try:
            tls = _server_side(pending.sock, self.key, time.monotonic() + handshake_timeout())
        except Exception as exc:  # noqa: BLE001 - a refused peer is logged, never fatal to the listener
            if pending.evicted:
                self._note_drop(peer)
            else:
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                log.warning("wire %s: refused %s: %s", format_address(self.address), peer, why)
            return
        finally:
            with self._lock:
                if pending in self._pending:
                    self._pending.remove(pending)
        with self._lock:
            if not pending.evicted:
                self._known.add(pending.source)
        if self._closed or pending.evicted:  # pushed out just as it finished: its socket is shut
            tls.close()
        else:
            self._ready.put((tls, peer))

    def accept(self, messages: TypeAdapter[Any], timeout: Optional[float] = None) -> Channel:
        """The next authenticated connection; ``TimeoutError`` after ``timeout`` seconds."""
        try:
            tls, peer = self._ready.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no authenticated connection within {timeout:g} s") from None
        return Channel(tls, messages, peer)

    def close(self) -> None:
        """Stop listening now: once this returns, the port can be bound again (a resumed run
        binds its rendezvous anew). Closing alone is not enough: the accept thread's poll
        holds the socket, still listening, until it wakes (up to its 0.5 s timeout);
        shutting it down first wakes the poll and ends the listening at once. The local
        socket's file goes too, unless another listener has put its own in its place."""
        self._closed = True
        for sock in (self._sock, self._local):
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # not listening any more (closed before)
                pass
            sock.close()
        if self.local_path is not None:
            with contextlib.suppress(OSError):
                if os.stat(self.local_path).st_ino == self._local_ino:
                    os.unlink(self.local_path)
        for thread in self._acceptors:
            if thread is not threading.current_thread():
                thread.join(timeout=2.0)
        while True:
            try:
                self._ready.get_nowait()[0].close()
            except queue.Empty:
                return


def listen(host: str, port: int = 0, key: Optional[bytes] = None, local: bool = True) -> Listener:
    return Listener(host, port, key, local)


def connect(address: tuple[str, int], messages: TypeAdapter[Any], key: Optional[bytes] = None,
            timeout: Optional[float] = None) -> Channel:
    """Connect, handshake and wait for the server's welcome within ``timeout`` (default
    ``FLUXRL_WIRE_HANDSHAKE_S``): over the listener's local socket when this user has one
    for ``address`` on this host, else over TCP. A peer that refuses our certificate raises
    :class:`KeyRefused`, one that does not answer :class:`HandshakeFailed`; an unreachable
    one ``OSError``."""
    timeout = handshake_timeout() if timeout is None else timeout
    deadline = time.monotonic() + timeout
    name = format_address(address)
    try:
        opened = open_local(address, timeout)
    except socket.timeout as exc:
        raise HandshakeFailed(f"{name}: its local socket did not take the connection within {timeout:g} s") from exc
    if opened is not None:
        sock, name = opened[0], f"{name} (local socket)"
    else:
        sock = socket.create_connection(address, timeout=timeout)
    _tune(sock)
    tls = Tls(sock, tls_context(key or cluster_key(), server=False), server=False)
    try:
        tls.handshake(deadline)
        if bytes(read_exact(tls, 1, deadline)) != _WELCOME:
            raise HandshakeFailed(f"{name} is not a fluxrl wire endpoint")
        sock.settimeout(None)
    except ssl.SSLError as exc:
        tls.close()
        raise KeyRefused(f"{name} refused the TLS handshake (not the same {KEY_ENV}?): {exc}") from exc
    except (EOFError, socket.timeout) as exc:
        tls.close()
        raise HandshakeFailed(f"{name} closed or did not answer the handshake within {timeout:g} s (not the same "
                              f"{KEY_ENV}?)") from exc
    except BaseException:
        tls.close()
        raise
    return Channel(tls, messages, name)
