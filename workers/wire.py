"""Typed messages between the run's processes over authenticated connections.

Roles on different processes (and nodes) talk through ``multiprocessing.connection``
sockets: the handshake proves both ends hold the run's cluster key (an HMAC challenge,
so a stranger on the network cannot connect), and every message is pydantic JSON, never
a pickle, so even a peer that holds the key cannot make the other run code. A message
may carry one binary attachment (a safetensors blob) sent as a second frame.
"""
from __future__ import annotations

import os
import secrets
import threading
from multiprocessing.connection import Client, Connection, Listener
from typing import Optional

from pydantic import BaseModel, ConfigDict, TypeAdapter

KEY_ENV = "FLUXRL_CLUSTER_KEY"  # hex; every process of a run must have the same


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def cluster_key() -> bytes:
    """The run's key from the environment, or a new one (set in the environment so the
    processes this one starts inherit it)."""
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


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not a host:port address: {text!r}")
    return host, int(port)


def format_address(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


class Channel:
    """One end of a connection: ``send`` from any thread, ``recv`` from one."""

    def __init__(self, conn: Connection, messages: TypeAdapter):
        self.conn = conn
        self.messages = messages
        self._send_lock = threading.Lock()

    def send(self, message: BaseModel, blob: Optional[bytes] = None) -> None:
        header = message.model_dump_json().encode()
        with self._send_lock:
            self.conn.send_bytes(b"B" + header if blob is not None else b"M" + header)
            if blob is not None:
                self.conn.send_bytes(blob)

    def recv(self):
        """(message, blob or None); raises EOFError / OSError when the peer is gone."""
        frame = self.conn.recv_bytes()
        blob = self.conn.recv_bytes() if frame[:1] == b"B" else None
        return self.messages.validate_json(frame[1:]), blob

    def poll(self, timeout: float) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


def listen(host: str, port: int = 0, key: Optional[bytes] = None) -> Listener:
    return Listener((host, port), family="AF_INET", authkey=key or cluster_key())


def connect(address: tuple[str, int], messages: TypeAdapter, key: Optional[bytes] = None) -> Channel:
    return Channel(Client(address, family="AF_INET", authkey=key or cluster_key()), messages)
