"""torch.distributed ``TCPStore`` masters bound to one address.

A store server is unauthenticated: whoever reaches it can set, overwrite or flood its
keys. torch's own server binds the wildcard address whatever host it is given, so the
socket is bound here, to the address the run's plan names (loopback on one machine,
the node's own address across nodes), and handed over as ``master_listen_fd``.
"""
from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
from typing import Optional

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bound_listener(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` only (never the wildcard)."""
    if host in ("", "0.0.0.0", "::"):
        raise ValueError(f"refusing to serve a store on the wildcard address {host!r}")
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve a store on {host}:{port} ({exc.strerror}): on several nodes "
                                     f"the master address must be this node's own") from exc
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def master_store(host: str, port: int, world_size: Optional[int], timeout: datetime.timedelta,
                 wait_for_workers: bool = False):
    """A ``TCPStore`` master listening on ``host``:``port`` (0: any free port; ``.port`` says which)."""
    import torch.distributed as dist

    sock = bound_listener(host, port)
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store owns (and closes) the descriptor from here on
    try:
        return dist.TCPStore(host, bound, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=wait_for_workers, master_listen_fd=fd)
    except BaseException:
        try:
            socket.close(fd)
        except OSError:
            pass
        raise


def interface_of(host: str) -> Optional[str]:
    """The network interface holding ``host``'s address, if any (for GLOO_SOCKET_IFNAME)."""
    import psutil

    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] in wanted for a in addrs):
            return name
    return None
