"""The wire's transport under its channels (workers/io/wire.py): the errors a connection fails
with, host:port addresses, the run's certificate authority derived from the cluster key,
and TLS 1.3 over a plain socket, usable from one reader and many writers at once."""
from __future__ import annotations

import datetime
import functools
import os
import secrets
import select
import socket
import ssl
import tempfile
import threading
import time
from typing import Optional, cast

_CHUNK = 1 << 20  # plaintext handed to TLS at a time (bounds the encrypted copy in memory)


class WireError(ConnectionError):
    """The connection failed and was closed (TLS error, bad frame, refused peer)."""


class FrameTooLarge(WireError):
    """A length prefix over the cap: the connection is closed before anything is allocated."""


class BadFrame(WireError):
    """A frame that is not a valid message of the channel's protocol."""


class HandshakeFailed(WireError):
    """The peer did not finish the handshake (closed, or did not answer in time)."""


class KeyRefused(HandshakeFailed):
    """The TLS handshake failed: the peer does not hold this run's cluster key (or we not its)."""



def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not a host:port address: {text!r}")
    return host, int(port)


def format_address(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"



# -- the run's certificate authority, derived from the key -------------------------------------
@functools.lru_cache(maxsize=8)
def _credentials(key: bytes) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM) of the run: the same in every process that holds
    ``key`` (HKDF -> an Ed25519 key; fixed name, serial and validity; Ed25519 signs
    deterministically, so the certificate is byte for byte the same)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    from cryptography.x509.oid import NameOID

    def derive(info: bytes, length: int) -> bytes:
        return HKDF(algorithm=hashes.SHA256(), length=length, salt=b"fluxrl-wire-ca-v1", info=info).derive(key)

    private = Ed25519PrivateKey.from_private_bytes(derive(b"ed25519 key", 32))
    run_id = derive(b"name", 8).hex()  # names the run in errors without revealing the key
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fluxrl run {run_id}")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
            .serial_number(int(run_id, 16) | 1)
            .not_valid_before(datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc))
            .not_valid_after(datetime.datetime(2124, 1, 1, tzinfo=datetime.timezone.utc))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(private, None))  # Ed25519 signatures are deterministic: the same bytes everywhere
    key_pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


@functools.lru_cache(maxsize=16)
def tls_context(key: bytes, server: bool) -> ssl.SSLContext:
    cert_pem, key_pem = _credentials(key)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED  # both ways: the client must present the run's certificate too
    if server:
        ctx.num_tickets = 0  # no resumption, and no records after the handshake we did not ask for
    else:
        ctx.check_hostname = False  # the peer is identified by the run's CA, not by a host name
    ctx.load_verify_locations(cadata=cert_pem.decode())
    # load_cert_chain reads files only: the key goes there encrypted with a one-time password
    from cryptography.hazmat.primitives import serialization

    password = secrets.token_bytes(32)
    encrypted = serialization.load_pem_private_key(key_pem, None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(password))
    fd, path = tempfile.mkstemp(prefix="fluxrl-wire-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cert_pem + encrypted)
        ctx.load_cert_chain(path, password=password)
    finally:
        os.unlink(path)
    return ctx


# -- TLS over a socket, usable from one reader and many writers at once -----------------------
class Tls:
    """An ``ssl.SSLObject`` over memory BIOs on a plain socket. OpenSSL does not allow one
    SSL object to be used from two threads at once, yet a channel is read by one thread
    while others send: every call into it holds ``_ssl``, and the blocking socket I/O is
    done outside that lock (``_send`` orders the encrypted bytes on the socket)."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, server: bool):
        self.sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self._in, self._out, server_side=server)
        self._ssl = threading.Lock()
        self._send = threading.Lock()  # taken before _ssl, never after
        self.closed = False

    def handshake(self, deadline: float) -> None:
        while True:
            try:
                with self._ssl:
                    self.obj.do_handshake()
                self._flush()
                return
            except ssl.SSLWantReadError:
                self._flush()
                self._fill(deadline)
            except ssl.SSLError:
                try:  # the alert, so that the peer learns why
                    self._flush()
                except OSError:
                    pass
                raise

    def _fill(self, deadline: Optional[float]) -> None:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout("timed out")
            self.sock.settimeout(remaining)
        data = self.sock.recv(1 << 18)
        if not data:
            raise EOFError("the peer closed the connection")
        with self._ssl:
            self._in.write(data)

    def _flush(self) -> None:
        with self._send:
            with self._ssl:
                data = self._out.read()
            if data:
                self.sock.sendall(data)

    def write(self, data: bytes) -> None:
        """Caller holds ``_send`` (a whole frame goes out in one piece)."""
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _CHUNK):
            with self._ssl:
                self.obj.write(view[start:start + _CHUNK])
                encrypted = self._out.read()
            self.sock.sendall(encrypted)

    def read_into(self, view: memoryview, deadline: Optional[float] = None) -> None:
        """Fill ``view`` with plaintext (one reader at a time)."""
        got = 0
        while got < len(view):
            try:
                with self._ssl:
                    n = cast(int, self.obj.read(len(view) - got, view[got:]))  # into a buffer: a count
                if n == 0:
                    raise EOFError("the peer closed the connection")
                got += n
            except ssl.SSLWantReadError:
                with self._ssl:
                    answer = self._out.pending  # e.g. an alert
                if answer:
                    self._flush()
                self._fill(deadline)
            except ssl.SSLZeroReturnError:
                raise EOFError("the peer closed the connection") from None

    def readable(self, timeout: float) -> bool:
        with self._ssl:
            if self.obj.pending() or self._in.pending:
                return True
        ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        return bool(ready)

    def close(self) -> None:
        self.closed = True
        try:  # wakes a reader blocked in recv
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def read_exact(tls: Tls, n: int, deadline: Optional[float] = None) -> bytearray:
    buf = bytearray(n)
    tls.read_into(memoryview(buf), deadline)
    return buf
