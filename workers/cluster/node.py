"""Runs over several nodes: the coordinator (node 0, the controller's process) and one
node agent on every other node, joined through a rendezvous address.

    node 0:   python -m workers run spec.yaml --rendezvous HOST:PORT        (the coordinator)
    node r:   python -m workers node --rendezvous HOST:PORT --node-rank r   (r = 1 .. nodes-1)

Every process of the run holds the same cluster key (``FLUXRL_CLUSTER_KEY``, workers/
wire.py): the connections are mutually authenticated TLS 1.3 and carry typed JSON only.
An agent loads and saves trainer state only inside the run's folder (``--out``, or the
folder the coordinator names when the agent was started without it): a path outside it
is refused (:class:`PathRefused`).

A node agent connects twice (control: requests and replies; watch: nothing but its
liveness), receives its :class:`NodeAssignment` — the spec, the torch.distributed master
for the trainer world, the engine servers to start with their placement — starts its
engine servers (workers/rollout/server.py) and its trainer ranks (a ``TrainerGroup``
with ``node_rank``: workers/train/ranks.py), and answers :class:`NodeReady` with the
engines' addresses. The coordinator then talks to those engines directly, and drives
every node's trainer ranks with the same calls (:class:`ClusterTrainer`), since each
node's group trains its ranks' shares of the same batch.

Failure is the run's as a whole: a node agent that dies (or whose ranks die) fails the
coordinator's next trainer call and, through the watch connection, stops the run within
moments; a coordinator that dies makes every agent stop its processes and exit.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Annotated, Callable, Literal, Optional, Union

from pydantic import Field, TypeAdapter

from workers.io import wire
from workers.rollout.client import kill_session, launch_server
from workers.rollout.messages import EngineServerConfig
from workers.spec import RunSpec
from workers.train.rank_messages import Sample
from workers.train.ranks import TrainerRankError, _sample

if TYPE_CHECKING:
    from workers.weights.files import WeightFile

log = logging.getLogger(__name__)


class Join(wire.Message):
    kind: Literal["join"] = "join"
    node_rank: int
    channel: Literal["control", "watch"]
    host: str
    pid: int


class NodeAssignment(wire.Message):
    kind: Literal["assignment"] = "assignment"
    spec: RunSpec
    model_path: str
    pad_id: int
    master_addr: str
    master_port: int
    ranks: int  # trainer ranks on this node
    threads_per_rank: int | list[int] | None  # one for all local ranks, or each rank's
    cuda_devices: Optional[list[str]] = None  # per local rank
    engines: list[EngineServerConfig]
    run_dir: str = ""  # the run's folder: trainer paths must lie in it (unless the agent has its own --out)


class EngineAddress(wire.Message):
    index: int
    address: str
    pid: int


class NodeReady(wire.Message):
    kind: Literal["ready"] = "ready"
    node_rank: int
    engines: list[EngineAddress]
    trainer_pids: list[int]


class TrainerCall(wire.Message):
    """One ``TrainerGroup`` method, with what it takes."""
    kind: Literal["call"] = "call"
    id: int
    method: Literal["train_step", "begin_step", "accumulate", "finish_step", "state_dict", "save", "save_state",
                    "load_state", "prepare_weights"]
    samples: list[Sample] = []
    denominator: float = 1.0
    last: bool = False
    sequences: int = 0
    rescale: bool = False
    path: str = ""
    version: int = 0
    bucket_bytes: int = 0


class TrainerCalled(wire.Message):
    kind: Literal["called"] = "called"
    id: int
    version: int
    error: Optional[str] = None
    rank: Optional[int] = None
    exitcode: Optional[int] = None


class NodeFailed(wire.Message):
    """The agent could not start its part (before ``NodeReady``)."""
    kind: Literal["failed"] = "failed"
    node_rank: int
    error: str


class Shutdown(wire.Message):
    kind: Literal["shutdown"] = "shutdown"


ToCoordinator = Annotated[Union[Join, NodeReady, TrainerCalled, NodeFailed], Field(discriminator="kind")]
ToNode = Annotated[Union[NodeAssignment, TrainerCall, Shutdown], Field(discriminator="kind")]
TO_COORDINATOR: TypeAdapter = TypeAdapter(ToCoordinator)
TO_NODE: TypeAdapter = TypeAdapter(ToNode)


class NodeError(RuntimeError):
    """A node of the run failed or stopped answering: the run fails as a whole."""


class PathRefused(PermissionError):
    """A trainer call named a path outside the run's folder."""


def confined(path: str, run_dir: str) -> str:
    """``path`` resolved (symlinks too), if it lies inside ``run_dir``; else :class:`PathRefused`."""
    if not run_dir:
        raise PathRefused(f"{path!r}: this node agent has no run folder to load from or save to "
                          "(start it with --out DIR)")
    root = os.path.realpath(run_dir)
    resolved = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, resolved]) != root:
        raise PathRefused(f"{path!r} resolves to {resolved}, outside the run's folder {root}: refused")
    return resolved


# -- the coordinator's side ------------------------------------------------------------------
class _Node:
    def __init__(self, rank: int, host: str, pid: int):
        self.rank, self.host, self.pid = rank, host, pid
        self.control: Optional[wire.Channel] = None
        self.watch: Optional[wire.Channel] = None


WILDCARDS = ("", "0.0.0.0", "::", "[::]")


class Cluster:
    """The rendezvous on node 0: waits for every other node's agent, hands out the
    assignments, and carries trainer calls to the agents."""

    def __init__(self, rendezvous: str, nodes: int, join_timeout_s: float = 600.0):
        self.host, port = wire.parse_address(rendezvous)
        if self.host in WILDCARDS:  # it is handed to the other nodes as the trainer world's master address
            raise ValueError(f"--rendezvous {rendezvous}: a wildcard address listens everywhere and names no host "
                             "the other nodes can reach; give node 0's own address on the cluster network "
                             "(e.g. --rendezvous 10.0.0.1:29400)")
        wire.shared_key()
        self.nodes: dict[int, _Node] = {}
        self._listener = wire.listen(self.host, port)
        self._closed = False
        self._failure: Optional[NodeError] = None
        self.on_failure: Optional[Callable[[NodeError], None]] = None
        self._ids = iter(range(1, 1 << 62))
        deadline = time.monotonic() + join_timeout_s
        waiting = set(range(1, nodes))
        log.info("rendezvous on %s: waiting for node(s) %s", rendezvous, sorted(waiting))
        while waiting or any(n.control is None or n.watch is None for n in self.nodes.values()):
            channel, join = self._accept(deadline)
            if join is None:
                continue
            if join.node_rank not in range(1, nodes):
                channel.close()
                log.warning("a node agent with node rank %d joined a run of %d node(s): refused", join.node_rank, nodes)
                continue
            node = self.nodes.setdefault(join.node_rank, _Node(join.node_rank, join.host, join.pid))
            setattr(node, join.channel, channel)
            waiting.discard(join.node_rank)
        for node in self.nodes.values():
            threading.Thread(target=self._watch, args=(node,), name=f"cluster-watch-{node.rank}", daemon=True).start()

    def _accept(self, deadline: float):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(1, len(self.nodes) + 2)) - set(self.nodes)) or "some"
            self.close()
            raise NodeError(f"node(s) {missing} did not join the rendezvous in time "
                            f"(python -m workers node --rendezvous {self.host}:... --node-rank R)")
        try:  # handshakes (and refusals) happen in the listener's threads, each with its deadline
            channel = self._listener.accept(TO_COORDINATOR, timeout=min(remaining, 1.0))
        except TimeoutError:
            return None, None
        if not channel.poll(wire.handshake_timeout()):
            log.warning("rendezvous: %s connected but did not say who it is: dropped", channel.peer)
            channel.close()
            return None, None
        try:
            join, _ = channel.recv()
        except (EOFError, OSError) as exc:
            log.warning("rendezvous: dropped %s: %s", channel.peer, exc)
            return None, None
        if not isinstance(join, Join):
            channel.close()
            return None, None
        return channel, join

    def assign(self, node_rank: int, assignment: NodeAssignment) -> None:
        self.nodes[node_rank].control.send(assignment)

    def ready(self, node_rank: int, timeout_s: float) -> NodeReady:
        reply = self._receive(self.nodes[node_rank], timeout_s, "starting its processes")
        if isinstance(reply, NodeFailed):
            raise NodeError(f"node {node_rank} could not start: {reply.error}")
        if not isinstance(reply, NodeReady):
            raise NodeError(f"node {node_rank} answered {reply.kind} instead of ready")
        return reply

    def send_call(self, call: TrainerCall) -> None:
        self._check()
        for node in self.nodes.values():
            try:
                node.control.send(call)
            except OSError:
                self._fail(node, "its connection broke")

    def gather_call(self, call: TrainerCall) -> list[TrainerCalled]:
        replies = []
        for node in self.nodes.values():
            reply = self._receive(node, None, call.method)
            if reply.error is not None:
                raise TrainerRankError(f"node {node.rank}: {reply.error}", reply.rank, reply.exitcode)
            replies.append(reply)
        return replies

    def errors_of(self, call: TrainerCall, timeout_s: float) -> list[TrainerRankError]:
        """After this node's ranks failed in ``call``: what the other nodes say of it (those
        that answer in time), to name the rank that caused it."""
        errors = []
        for node in self.nodes.values():
            try:
                reply = self._receive(node, timeout_s, call.method)
            except NodeError as exc:
                errors.append(TrainerRankError(str(exc)))
                continue
            if reply.error is not None:
                errors.append(TrainerRankError(f"node {node.rank}: {reply.error}", reply.rank, reply.exitcode))
        return errors

    def new_call(self, method: str, **kwargs) -> TrainerCall:
        return TrainerCall(id=next(self._ids), method=method, **kwargs)

    def _receive(self, node: _Node, timeout_s: Optional[float], what: str):
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._check()
            try:
                if node.control.poll(0.2):
                    reply, _ = node.control.recv()
                    return reply
            except EOFError:
                self._fail(node, f"it disconnected during {what}")
            except Exception as exc:  # noqa: BLE001 - a bad frame, a TLS error: the channel is closed, the run fails
                self._fail(node, f"its connection failed during {what}: {type(exc).__name__}: {exc}")
            if deadline is not None and time.monotonic() > deadline:
                self._fail(node, f"it did not finish {what} within {timeout_s:g} s")

    def _watch(self, node: _Node) -> None:
        """An agent's watch connection closes when its process dies (it never sends)."""
        try:
            message, _ = node.watch.recv()
            why = f"it sent {message.kind} on its watch connection"
        except EOFError:
            why = "its agent exited"
        except Exception as exc:  # noqa: BLE001 - any failure of the connection fails the run
            why = f"its watch connection failed: {type(exc).__name__}: {exc}"
        if self._closed:
            return
        try:
            self._fail(node, why)
        except NodeError:
            pass

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _fail(self, node: _Node, why: str):
        if self._failure is None and not self._closed:
            self._failure = NodeError(f"node {node.rank} (agent pid {node.pid} on {node.host}): {why}")
            log.error("%s", self._failure)
            if self.on_failure is not None:
                self.on_failure(self._failure)
        raise self._failure or NodeError(f"node {node.rank}: {why}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for node in self.nodes.values():
            for channel in (node.control, node.watch):
                if channel is None:
                    continue
                try:  # on the watch channel too: its closing must not read as the coordinator's death
                    channel.send(Shutdown())
                except OSError:
                    pass
                channel.close()
        self._listener.close()


class ClusterTrainer:
    """The trainer over every node: this node's ``TrainerGroup`` plus the same calls sent
    to every other node's (the interface the controller uses of ``Trainer``). Paths go out
    absolute: an agent resolves a relative one against its run folder, not our cwd."""

    def __init__(self, local, cluster: Cluster):
        self.local, self.cluster = local, cluster

    @property
    def version(self) -> int:
        return self.local.version

    @property
    def world(self) -> int:
        """Trainer ranks on every node (this node's group knows the world it joined)."""
        return self.local.world

    def _all(self, method: str, call_kwargs: dict, local_call: Callable):
        call = self.cluster.new_call(method, **call_kwargs)
        self.cluster.send_call(call)
        try:
            result = local_call()
        except TrainerRankError as local_error:  # perhaps because a rank elsewhere died
            errors = [local_error] + self.cluster.errors_of(call, timeout_s=10.0)
            # the cause first: a rank that was killed (negative exit code), not one that then failed with it
            errors.sort(key=lambda e: not (e.exitcode is not None and e.exitcode < 0))
            raise TrainerRankError("; ".join(map(str, errors)), errors[0].rank, errors[0].exitcode) from local_error
        self.cluster.gather_call(call)
        return result

    def train_step(self, batch):
        return self._all("train_step", {"samples": [_sample(s) for s in batch]},
                         lambda: self.local.train_step(batch))

    def begin_step(self) -> None:
        self._all("begin_step", {}, self.local.begin_step)

    def accumulate(self, batch, denominator: float = 1.0, last: bool = False) -> None:
        self._all("accumulate", {"samples": [_sample(s) for s in batch], "denominator": denominator, "last": last},
                  lambda: self.local.accumulate(batch, denominator, last))

    def finish_step(self, sequences: int, rescale: bool = False):
        return self._all("finish_step", {"sequences": sequences, "rescale": rescale},
                         lambda: self.local.finish_step(sequences, rescale))

    def state_dict(self):
        return self._all("state_dict", {}, self.local.state_dict)

    def write_weight_file(self, path: str) -> "Optional[WeightFile]":
        """Written by global rank 0 on this node; the other nodes' ranks take part in the
        gather (their ``state_dict`` keeps nothing)."""
        return self._all("state_dict", {}, lambda: self.local.write_weight_file(path))

    def save(self, path: str) -> None:
        self._all("save", {"path": os.path.abspath(path)}, lambda: self.local.save(path))

    def save_state(self, folder: str) -> None:
        self._all("save_state", {"path": os.path.abspath(folder)}, lambda: self.local.save_state(folder))

    def load_state(self, folder: str) -> int:
        return self._all("load_state", {"path": os.path.abspath(folder)}, lambda: self.local.load_state(folder))

    @property
    def pids(self) -> list[int]:
        """This node's trainer rank processes."""
        return self.local.pids

    # the weight group: global rank 0 is on this node; every rank takes part in the gather
    def host_weight_group(self, host: str, world: int, backend: str, timeout_s: float) -> dict:
        return self.local.host_weight_group(host, world, backend, timeout_s)

    def form_weight_group(self) -> None:
        self.local.form_weight_group()

    def prepare_weights(self, version: int, bucket_bytes: int):
        return self._all("prepare_weights", {"version": version, "bucket_bytes": bucket_bytes},
                         lambda: self.local.prepare_weights(version, bucket_bytes))

    def send_weights(self):
        return self.local.send_weights()

    def leave_weight_group(self) -> None:
        self.local.leave_weight_group()

    def close(self) -> None:
        try:
            self.local.close()
        finally:
            self.cluster.close()


# -- the agent's side ------------------------------------------------------------------------
def _call_group(group, call: TrainerCall, run_dir: str = "") -> None:
    from workers.train.rank_process import _Rank

    batch = _Rank._samples(call.samples)
    if call.method == "train_step":
        group.train_step(batch)
    elif call.method == "accumulate":
        group.accumulate(batch, call.denominator, call.last)
    elif call.method == "finish_step":
        group.finish_step(call.sequences, call.rescale)
    elif call.method in ("save", "save_state", "load_state"):
        getattr(group, call.method)(confined(call.path, run_dir))
    elif call.method == "prepare_weights":
        group.prepare_weights(call.version, call.bucket_bytes)
    else:
        getattr(group, call.method)()


def run_node(rendezvous: str, node_rank: int, host: Optional[str] = None, run_dir: Optional[str] = None) -> int:
    """A node agent: join, start this node's engine servers and trainer ranks, serve the
    coordinator's trainer calls until it says stop (0) or is gone (1). Trainer state is
    loaded and saved only inside ``run_dir`` (default: the run folder the coordinator names)."""
    from workers.train.ranks import TrainerGroup

    address = wire.parse_address(rendezvous)
    wire.shared_key()
    host = host or _reachable_host(address)
    control = _connect(address, Join(node_rank=node_rank, channel="control", host=host, pid=os.getpid()))
    watch = _connect(address, Join(node_rank=node_rank, channel="watch", host=host, pid=os.getpid()))
    servers: list = []
    group = None

    def cleanup() -> None:
        for proc in servers:
            kill_session(proc.pid)
        if group is not None:
            group.close()

    def coordinator_gone() -> None:  # the watch connection closes without a word: the run is over
        try:
            if isinstance(watch.recv()[0], Shutdown):
                return  # an orderly end: the control channel says it too
        except EOFError:
            pass
        except Exception as exc:  # noqa: BLE001 - a broken connection is a lost coordinator
            log.error("node %d: the watch connection failed: %s: %s", node_rank, type(exc).__name__, exc)
        log.error("node %d: the coordinator is gone; stopping this node's processes", node_rank)
        for proc in servers:
            kill_session(proc.pid)
        os._exit(1)  # the trainer ranks see their parent go and exit

    threading.Thread(target=coordinator_gone, name="watch-coordinator", daemon=True).start()
    try:
        assignment, _ = control.recv()
        if not isinstance(assignment, NodeAssignment):
            raise NodeError(f"expected an assignment, got {assignment.kind}")
        run_dir = run_dir or assignment.run_dir
        log.info("node %d: trainer state is loaded and saved only under %s", node_rank, run_dir or "(nowhere)")
        try:
            engines = []
            for config in assignment.engines:
                proc, addr, pid = launch_server(config.model_copy(update={"host": host}))
                servers.append(proc)
                engines.append(EngineAddress(index=config.index, address=addr, pid=pid))
            group = TrainerGroup(assignment.spec, assignment.model_path, assignment.ranks, assignment.threads_per_rank,
                                 assignment.pad_id, master_addr=assignment.master_addr,
                                 master_port=assignment.master_port, nnodes=assignment.spec.resources.nodes,
                                 node_rank=node_rank, cuda_devices=assignment.cuda_devices)
        except Exception as exc:  # noqa: BLE001 - told to the coordinator, which fails the run
            control.send(NodeFailed(node_rank=node_rank, error=f"{type(exc).__name__}: {exc}"))
            raise
        control.send(NodeReady(node_rank=node_rank, engines=engines, trainer_pids=group.pids))
        log.info("node %d ready: engines %s, trainer ranks (pids %s)", node_rank, [e.index for e in engines],
                 group.pids)
        while True:
            message, _ = control.recv()
            if isinstance(message, Shutdown):
                return 0
            try:
                _call_group(group, message, run_dir)
                control.send(TrainerCalled(id=message.id, version=group.version))
            except TrainerRankError as exc:
                control.send(TrainerCalled(id=message.id, version=group.version, error=str(exc), rank=exc.rank,
                                           exitcode=exc.exitcode))
            except Exception as exc:  # noqa: BLE001
                control.send(TrainerCalled(id=message.id, version=group.version, error=f"{type(exc).__name__}: {exc}"))
    except (EOFError, OSError) as exc:  # wire errors are OSErrors: the channel is closed
        log.error("node %d: lost the coordinator: %s: %s", node_rank, type(exc).__name__, exc)
        return 1
    finally:
        cleanup()


def _connect(address: tuple[str, int], join: Join, timeout_s: float = 600.0) -> wire.Channel:
    """Connect to the rendezvous, retrying while node 0 is not up yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            channel = wire.connect(address, TO_NODE)
            channel.send(join)
            return channel
        except wire.KeyRefused:  # retrying will not help
            raise
        except OSError:  # node 0 not listening yet, or slow to answer
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _reachable_host(rendezvous: tuple[str, int]) -> str:
    """The address of this machine that the coordinator can reach: the one it uses to route there."""
    if rendezvous[0] in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(rendezvous)
        return s.getsockname()[0]
