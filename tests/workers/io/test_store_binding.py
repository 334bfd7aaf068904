"""The run's torch.distributed stores are not open to the network: the DeepSpeed world's
and the weight group's store masters listen on loopback only (one machine), nothing of
the run listens on another address, a connection to this machine's other address is
refused, and a key set by an outsider under the old fixed abort name does not fail an
update (each update's abort key is random and travels only with its RPC).

Real processes and sockets throughout: the listening sockets are read with psutil."""
import datetime
import ipaddress
import multiprocessing as mp
import socket
import time

import psutil
import pytest
import torch

from workers.io.ports import free_port
from workers.spec import validate_spec
from workers.train.ranks import TrainerGroup
from workers.weights.weight_group import (ABORT_PREFIX, WeightBroadcastError, WeightGroup, describe_state_dict,
                                          host_group)
from workers.weights.sync import tensors_checksum

OLD_ABORT_KEY = "fluxrl/weights/abort"  # a fixed name an attacker could guess


def _listening(pids) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket listening in ``pids`` and their descendants."""
    procs = {}
    for pid in pids:
        p = psutil.Process(pid)
        procs[p.pid] = p
        for child in p.children(recursive=True):
            procs[child.pid] = child
    out = []
    for pid, p in procs.items():
        try:
            conns = p.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        out += [(pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def _not_loopback(listeners):
    return [entry for entry in listeners if not ipaddress.ip_address(entry[1].split("%")[0]).is_loopback]


def _other_address():
    """An address of this machine that is not loopback (None: it has none)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                ip = ipaddress.ip_address(a.address.split("%")[0])
                if not ip.is_loopback and not ip.is_link_local:
                    return a.address
    return None


def _assert_unreachable_from(address, port: int) -> None:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(3.0)
        with pytest.raises(OSError):  # refused (nothing listens there), or no route
            s.connect((address, port))


def _odd_state():
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(64, 16, generator=g), "b": torch.randn(1000, generator=g).to(torch.bfloat16)}


def _receive(join, meta, queue):
    group = WeightGroup("127.0.0.1", join["port"], 1, 2, "gloo", 10.0)
    queue.put("joined")
    try:
        got = group.receive(meta)
        queue.put(("ok", tensors_checksum(got)))
    except WeightBroadcastError as exc:
        queue.put(("error", str(exc)))
    finally:
        group.close()


def _start_receiver(join, meta):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_receive, args=(join, meta, queue), daemon=True)
    child.start()
    return child, queue


def _outsider(port: int):
    return torch.distributed.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=10))


@pytest.mark.timeout(120)
def test_a_gloo_weight_group_listens_on_loopback_only_and_refuses_another_address():
    join, form = host_group("127.0.0.1", 2, "gloo", 10.0)
    meta, sources = describe_state_dict(_odd_state(), 1, 4096)
    child, queue = _start_receiver(join, meta)
    try:
        group = form()
        assert queue.get(timeout=30) == "joined"
        listeners = _listening([psutil.Process().pid, child.pid])
        assert ("127.0.0.1", join["port"]) in [(ip, port) for _, ip, port in listeners]  # the store master
        assert _not_loopback(listeners) == []
        other = _other_address()
        if other is not None:
            _assert_unreachable_from(other, join["port"])
        group.send(meta, sources, lambda: False)
        assert queue.get(timeout=30) == ("ok", tensors_checksum(_odd_state()))
        group.close()
    finally:
        child.join(30)


@pytest.mark.timeout(120)
def test_an_outsider_setting_the_old_fixed_abort_key_does_not_fail_an_update():
    join, form = host_group("127.0.0.1", 2, "gloo", 10.0)
    meta, sources = describe_state_dict(_odd_state(), 2, 4096)
    assert meta["abort_key"].startswith(ABORT_PREFIX) and len(meta["abort_key"]) == len(ABORT_PREFIX) + 32
    assert describe_state_dict(_odd_state(), 2, 4096)[0]["abort_key"] != meta["abort_key"]  # fresh per update
    # The outsider sets the keys before the update and leaves: a receiver watching them
    # would stop at its first look. (A third client connected to the store *while* the
    # group forms and broadcasts sometimes breaks the member's own store connection in
    # torch's store server; that is a local process's denial of service, not the key
    # confusion this test is about, and on one node the store is reachable from this
    # host only.)
    outsider = _outsider(join["port"])
    outsider.set(OLD_ABORT_KEY, "1")
    outsider.set(ABORT_PREFIX, "1")
    del outsider
    child, queue = _start_receiver(join, meta)
    try:
        group = form()
        assert queue.get(timeout=30) == "joined"
        time.sleep(0.3)  # longer than a wait slice: a receiver watching those keys would have stopped
        group.send(meta, sources, lambda: False)
        assert queue.get(timeout=30) == ("ok", tensors_checksum(_odd_state()))
        group.close()
    finally:
        child.join(30)


@pytest.mark.timeout(120)
def test_the_updates_own_abort_key_still_stops_a_receiver_within_a_second():
    join, form = host_group("127.0.0.1", 2, "gloo", 10.0)
    meta, _ = describe_state_dict(_odd_state(), 3, 4096)
    child, queue = _start_receiver(join, meta)
    try:
        group = form()
        assert queue.get(timeout=30) == "joined"
        time.sleep(0.5)  # the receiver waits for the header, which never comes
        t0 = time.monotonic()
        group.abort(meta["abort_key"])
        outcome, message = queue.get(timeout=10)
        assert outcome == "error" and "aborted" in message
        assert time.monotonic() - t0 < 1.0  # not the group's 10 s timeout
        group.close()
    finally:
        child.join(30)


def _spec():
    return validate_spec({"name": "stores", "model": {"path": "builtin:tiny"},
                          "task": {"dataset": "gen:add?max_digits=2"}, "reward": {"function": "numeric_match"},
                          "trainer": {"micro_batch_tokens": 24}, "algorithm": {"lr": 1e-2, "warmup_steps": 0}})


@pytest.mark.engine
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_two_rank_trainer_and_its_weight_group_listen_on_loopback_only(tiny_model_path):
    """The DeepSpeed world's store (rank 0, MASTER_PORT), gloo's pair sockets and the weight
    group that trainer rank 0 hosts: all on loopback while a weight update crosses."""
    master_port = free_port("127.0.0.1")
    with TrainerGroup(_spec(), tiny_model_path, 2, 1, 0, master_port=master_port) as group:
        join = group.host_weight_group("127.0.0.1", 2, "gloo", 20.0)
        meta = group.prepare_weights(1, 2**20)
        _outsider(join["port"]).set(OLD_ABORT_KEY, "1")  # before the members join (see the test above)
        child, queue = _start_receiver(join, meta)
        try:
            group.form_weight_group()
            assert queue.get(timeout=30) == "joined"
            listeners = _listening([psutil.Process().pid, *group.pids, child.pid])
            bound = {(pid, ip, port) for pid, ip, port in listeners}
            assert (group.pids[0], "127.0.0.1", master_port) in bound  # the world's store, in rank 0
            assert (group.pids[0], "127.0.0.1", join["port"]) in bound  # the weight group's, in rank 0
            assert _not_loopback(listeners) == []
            other = _other_address()
            if other is not None:
                _assert_unreachable_from(other, master_port)
                _assert_unreachable_from(other, join["port"])
            assert group.send_weights() is None
            outcome, checksum = queue.get(timeout=60)
            assert outcome == "ok"
            assert checksum == tensors_checksum(group.state_dict())
            group.leave_weight_group()
        finally:
            child.join(30)


def _single_trainer(model_path, queue):
    from workers.train.trainer import Trainer

    Trainer(_spec(), model_path, threads=1)
    queue.put([(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
               if c.status == psutil.CONN_LISTEN])


@pytest.mark.engine
@pytest.mark.timeout(180)
def test_a_single_process_trainer_serves_no_store_on_every_interface(tiny_model_path):
    """One in-process trainer is its own world: an in-memory store, no TCP store at all
    (env://'s would serve one on the wildcard address)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_single_trainer, args=(tiny_model_path, queue), daemon=True)
    child.start()
    try:
        listeners = queue.get(timeout=150)
    finally:
        child.join(30)
    assert [(ip, port) for ip, port in listeners if ip in ("0.0.0.0", "::")] == []
