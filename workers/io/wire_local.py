"""The local wire (workers/io/wire.py): a Unix socket per listener, for this user's processes on
this host, in this user's folder ``FLUXRL_WIRE_DIR``, named by the TCP address it stands for
and this network namespace; the kernel names each peer (``SO_PEERCRED``)."""
from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import socket
import stat
import struct
import tempfile
from pathlib import Path
from typing import Optional

from workers.io.wire_tls import WireError, format_address

log = logging.getLogger(__name__)

LOCAL_DIR_ENV = "FLUXRL_WIRE_DIR"  # this user's local listeners (Unix sockets)
LOCAL_ENV = "FLUXRL_WIRE_LOCAL"  # "0": TCP only, also between processes of one host
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


class LocalPeerRefused(WireError):
    """A local socket whose other end is not a process of this user."""


def local_enabled() -> bool:
    return os.environ.get(LOCAL_ENV, "1") != "0" and hasattr(socket, "AF_UNIX") and hasattr(socket, "SO_PEERCRED")


def net_namespace() -> int:
    """This process's network namespace (0 where unreadable): 127.0.0.1:port means one
    listener per namespace, and a shared /tmp may be seen from several."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def local_dir(create: bool) -> Optional[Path]:
    """This user's folder of local listeners, or None where there is none to use: missing
    (``create`` False), or not this user's alone (logged; TCP is used then)."""
    folder = Path(os.environ.get(LOCAL_DIR_ENV) or Path(tempfile.gettempdir()) / f"fluxrl-wire-{os.getuid()}")
    try:
        if create:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.lstat()  # a symlink planted in its place is refused, not followed
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("wire: the local folder %s (%s) is unusable: %s; using TCP", folder, LOCAL_DIR_ENV, exc)
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("wire: %s (%s) must be a folder of this user's, closed to others (mode 700); using TCP",
                    folder, LOCAL_DIR_ENV)
        return None
    return folder


def local_name(host: str, port: int) -> str:
    """The socket that stands for ``host:port`` of this network namespace (a fixed length,
    whatever the address: a Unix socket's path is short)."""
    digest = hashlib.sha256(f"{net_namespace()}|{host}|{port}".encode()).hexdigest()[:24]
    return f"{digest}.sock"


def _is_this_host(ip: "ipaddress.IPv4Address | ipaddress.IPv6Address") -> bool:
    """Whether ``ip`` is an address of this host in this namespace (it can be bound here)."""
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(ip), 0))
        return True
    except OSError:
        return False


def _local_candidates(address: tuple[str, int]) -> list[str]:
    """Socket names a listener at ``address`` on this host would have: the address itself,
    and a wildcard listener's, when the address is this host's. Host names other than
    localhost are not resolved here (TCP resolves them)."""
    host, port = address
    host = host.strip("[]")
    if host == "localhost":
        ips = [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    else:
        try:
            ips = [ipaddress.ip_address(host)]
        except ValueError:
            return []
    names: list[str] = []
    for ip in ips:
        names.append(local_name(ip.compressed, port))
        if _is_this_host(ip):
            names.append(local_name("::" if ip.version == 6 else "0.0.0.0", port))
    return names


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, as the kernel saw it
    connect (a client) or listen (a server)."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


def open_local(address: tuple[str, int], timeout: float) -> Optional[tuple[socket.socket, str]]:
    """A connection to the local socket of the listener at ``address``, if this user has one
    there; None otherwise (the caller uses TCP). A stale socket (its process is gone) is
    skipped. A socket of another user is refused: the folder is this user's, so one there
    means something is wrong."""
    if not local_enabled():
        return None
    names = _local_candidates(address)
    folder = local_dir(create=False) if names else None
    if folder is None or net_namespace() == 0:
        return None
    for name in names:
        path = folder / name
        if not path.exists():
            continue
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            continue
        except BaseException:
            sock.close()
            raise
        _, uid, _ = peer_credentials(sock)
        if uid != os.getuid():
            sock.close()
            raise LocalPeerRefused(f"the local socket {path} for {format_address(address)} is held by uid {uid}, "
                                   f"not this user ({os.getuid()}): refused")
        return sock, str(path)
    return None

