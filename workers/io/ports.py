"""A free port for a listener that another process binds later.

A port the kernel picks for ``bind(0)`` comes from its ephemeral range, the one it also
gives every outgoing connection as its source port. Between choosing such a port and the
listener's bind (a rank's store, a run's rendezvous: seconds, a process start or a resume
apart) any connection on the host may take it, and the bind fails with EADDRINUSE. A
client that retries a loopback port in that range with no listener yet can even connect
to itself. So the port comes from just below the ephemeral range, where no connection is
given one, and is checked free when chosen. The choice draws on the OS's randomness, never
on ``random``'s global state: runs seed it (and a resumed run restores it), so two
processes, or a run and its resumption, would otherwise draw the same ports in turn."""
from __future__ import annotations

import random
import socket

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_DEFAULT_EPHEMERAL_LOW = 32768  # Linux's default; other systems start higher (49152)
_SPAN = 8192  # ports below the ephemeral range to choose from
_TRIES = 64
_CHOOSE = random.SystemRandom()


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def free_port(host: str) -> int:
    """A port free on ``host`` now, outside the ephemeral range when there is room below it
    (else the kernel's pick)."""
    high = ephemeral_low()
    low = max(1024, high - _SPAN)
    for _ in range(_TRIES if high - low >= 256 else 0):
        port = _CHOOSE.randrange(low, high)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listener binds: TIME_WAIT is no use
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
