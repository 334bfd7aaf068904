"""Starting and stopping a run's roles: where every process runs (placement), the
trainer (in this process, rank processes of its own, or over several nodes whose agents
join at a rendezvous), the rollout engines (in this process or engine servers), the
weight group of the collective transport, and the reward service; and closing them all."""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Optional

from workers.io import wire
from workers.api import make_engines, make_trainer, trainer_devices, trainer_threads
from workers.cluster.placement import CRITIC_STAGE, REFERENCE_STAGE, REWARD_MODEL
from workers.rewards.service import RewardService
from workers.rollout.engine import RolloutEngine
from workers.rollout.engine_args import configure_cpu_environment
from workers.rollout.messages import EngineServerConfig
from workers.spec import RunSpec, model_dtype
from workers.train.reference import ReferenceStage
from workers.train.value_stage import ValueStage
from workers.weights.broadcast import RankZeroSender, WeightBroadcaster
from workers.weights.update import WeightUpdate

logger = logging.getLogger(__name__)


def placement(spec: RunSpec):
    """Where every process runs (workers/cluster/placement.py): this machine describes every node."""
    import torch

    from workers.cluster.host_memory import host_memory_gib
    from workers.cluster.placement import Machine, detect_machine, plan_placement

    if torch.cuda.is_available():
        return plan_placement(spec, detect_machine())
    return plan_placement(spec, Machine(cpu_cores=os.cpu_count() or 1, host_memory_gib=host_memory_gib()))


class Processes:
    """The run's processes: ``start``, ``start_trainer``, ``engines`` and
    ``start_engines``, ``open_weight_group``; ``close`` stops whatever was started.

    ``on_failure(error)`` is called in the loop when a node of a run over several nodes is
    lost; ``rendezvous`` is where those nodes' agents join; ``out`` is the run's folder."""

    def __init__(self, spec: RunSpec, out: Path, rendezvous: Optional[str], on_failure):
        self.spec = spec
        self.out = out  # the run's folder: the other nodes' run_dir
        self.rendezvous = rendezvous
        self.on_failure = on_failure
        self.plan = None
        self.trainer = None
        self.rewards: Optional[RewardService] = None
        self.reference: Optional[ReferenceStage] = None  # algorithm.kl_reference: stage
        self.critic_stage: Optional[ValueStage] = None  # critic.forward: stage
        self.remote_engines: dict[int, tuple] = {}  # engine index -> (address, pid) on another node
        self.node_trainer_pids: dict[int, list[int]] = {}

    def start(self, place) -> None:
        """The reward service, the placement (``place()``: the plan) and this machine's CPU
        environment."""
        self.plan = plan = place()
        described = plan.describe()  # before anything starts: where each process runs, what each GPU holds
        logger.info("placement: %s", described)
        (self.out / "plan.txt").write_text(described + "\n", encoding="utf-8")
        self.rewards = RewardService(self.spec.reward, model_placement=plan.inference(REWARD_MODEL),
                                     model_max_tokens=self.spec.inference.micro_batch_tokens)
        on_cpu = plan.device == "cpu"
        # In one process (no engine processes) every engine and the trainer share node 0's cores.
        configure_cpu_environment(plan.cpu_bind("engine") if on_cpu else None, self.spec.rollout.kv_cache_gb)

    async def start_trainer(self, checked):
        spec = self.spec
        if spec.resources.nodes > 1 and spec.trainer.pipeline.stages == 1:
            await self._join_nodes(checked)
        else:  # workers/api.py: the implementation the plan calls for
            self.trainer = await asyncio.to_thread(make_trainer, spec, self.plan, checked.pad_id)
        if spec.algorithm.kl_reference == "stage":  # the run's starting model, frozen, in a worker of its own
            self.reference = ReferenceStage(spec, spec.model.path, checked.pad_id, self.plan.inference(REFERENCE_STAGE))
            await asyncio.to_thread(self.reference.start)
        if spec.critic.forward == "stage":  # a copy of the critic, loaded from the trainer's (Controller.setup)
            self.critic_stage = ValueStage(spec, spec.model.path, checked.pad_id, self.plan.inference(CRITIC_STAGE))
            await asyncio.to_thread(self.critic_stage.start)
        return self.trainer

    def _threads_per_rank(self, node: int) -> int | list[int]:
        return trainer_threads(self.plan, node)

    def _trainer_devices(self, node: int) -> Optional[list[str]]:
        return trainer_devices(self.plan, node)

    async def _join_nodes(self, checked) -> None:
        """Several nodes: wait for every other node's agent at the rendezvous, give each its
        part (trainer ranks, engine servers), form the trainer world with them."""
        from workers.cluster.node import Cluster, ClusterTrainer, NodeAssignment
        from workers.io.ports import free_port
        from workers.train.ranks import TrainerGroup

        spec, nodes = self.spec, self.spec.resources.nodes
        if not self.rendezvous:
            raise ValueError(f"resources.nodes is {nodes}: a run over several nodes needs a rendezvous address "
                             "(python -m workers run SPEC --rendezvous HOST:PORT here, and python -m workers node "
                             "--rendezvous HOST:PORT --node-rank R on each other node)")
        cluster = await asyncio.to_thread(Cluster, self.rendezvous, nodes)
        loop = asyncio.get_running_loop()

        def node_failed(error: BaseException) -> None:  # from the cluster's watch thread
            loop.call_soon_threadsafe(self.on_failure, error)

        cluster.on_failure = node_failed
        try:
            master_addr = cluster.host  # node 0's own address (Cluster refuses a wildcard)
            master_port = free_port(master_addr)
            ranks = len(self.plan.on_node(0, "trainer"))
            for node in range(1, nodes):
                cluster.assign(node, NodeAssignment(
                    spec=spec, model_path=spec.model.path, pad_id=checked.pad_id, master_addr=master_addr,
                    master_port=master_port, ranks=ranks, threads_per_rank=self._threads_per_rank(node),
                    cuda_devices=self._trainer_devices(node), run_dir=str(self.out.resolve()),
                    engines=[self.engine_config(p, checked) for p in self.plan.on_node(node, "engine")]))
            local = asyncio.ensure_future(asyncio.to_thread(
                TrainerGroup, spec, spec.model.path, ranks, self._threads_per_rank(0), checked.pad_id,
                master_addr=master_addr, master_port=master_port, nnodes=nodes, node_rank=0,
                cuda_devices=self._trainer_devices(0)))
            try:
                ready = [await asyncio.to_thread(cluster.ready, node, 1800.0) for node in range(1, nodes)]
            except BaseException:
                local.add_done_callback(lambda t: t.cancelled() or t.exception() or t.result().close())
                raise
            self.trainer = ClusterTrainer(await local, cluster)
        except BaseException:
            cluster.close()
            raise
        self.remote_engines = {e.index: (e.address, e.pid) for r in ready for e in r.engines}
        self.node_trainer_pids = {r.node_rank: list(r.trainer_pids) for r in ready}
        logger.info("%d node(s) joined: engines %s", nodes, sorted(self.remote_engines))

    def max_num_seqs(self, index: int) -> int:
        """An engine's vLLM batch cap: a long-tail engine's own with skew_aware dispatch and a
        fixed split (its engines are the lowest indices, as Fleet.split chooses them)."""
        spec = self.spec
        tail = spec.schedule.long_tail
        if spec.schedule.dispatch == "skew_aware" and tail.max_num_seqs is not None and index < tail.engines:
            return tail.max_num_seqs
        return spec.rollout.max_num_seqs

    def engine_config(self, process, checked, host: str = "127.0.0.1") -> EngineServerConfig:
        """An engine server's configuration, with its placement (devices, cores, memory share)."""
        spec, ro = self.spec, self.spec.rollout
        return EngineServerConfig(
            model_path=spec.model.path, index=process.index, update_mode=ro.update_mode,
            max_model_len=checked.max_model_len, max_num_seqs=self.max_num_seqs(process.index), dtype=model_dtype(spec),
            seed=spec.seed + process.index, rpc_timeout_s=ro.rpc_timeout_s, top_p=ro.top_p, top_k=ro.top_k,
            stop=list(ro.stop), stop_token_ids=list(checked.stop_ids), kv_cache_gb=ro.kv_cache_gb,
            gpu_memory_utilization=process.gpu_memory_utilization, host=host, env=self.plan.env(process),
            cpu_single_process=self.plan.engine_single_process(ro.cpu_single_process), enforce_eager=ro.enforce_eager,
            sleep_mode=self.plan.sleeps, tensor_parallel=self.plan.tensor_parallel,
            priority_scheduling=spec.schedule.dispatch == "skew_aware",
            lora_rank=spec.model.lora.rank if spec.model.lora else None)

    def engines(self, checked) -> list[RolloutEngine]:
        """The rollout engines, not started yet: each a server process of its own
        (workers/rollout/server.py) as the plan says (always on GPUs), else in this one."""
        configs = [self.engine_config(p, checked) for p in self.plan.engines]
        return make_engines(self.spec, configs, in_process=not self.plan.engine_processes,
                            remote=self.remote_engines)

    def starts_beside_trainer(self) -> bool:
        """Whether the engines start while the trainer loads, all at once (``start_engines``
        with ``together``): on a CPU plan on one node. Start-up is mostly single-threaded
        (imports, vLLM's engine core process spawned and importing again), so on two cores
        the starts overlap well. GPU plans start them one after the other, after the
        trainer: vLLM sizes its KV cache from the memory it finds free, so nothing else may
        be allocating beside it."""
        return self.plan is not None and self.plan.device == "cpu" and self.spec.resources.nodes == 1

    async def start_engines(self, engines: list[RolloutEngine], weights: Optional[WeightUpdate], version: int,
                            together: bool = False) -> None:
        """``weights``: the first update (a file, or bytes: weights/update.py) and its
        ``version`` (on resume, the checkpoint's)."""
        if together:
            await asyncio.gather(*(engine.start(weights=weights, version=version) for engine in engines))
            return
        for engine in engines:  # one at a time: start-up is CPU-heavy
            await engine.start(weights=weights, version=version)

    async def open_weight_group(self, engines: list[RolloutEngine]) -> WeightBroadcaster:
        """rollout.weight_transport: collective: the group the trainer's weights go through."""
        ro, res = self.spec.rollout, self.spec.resources
        host = wire.parse_address(self.rendezvous)[0] if res.nodes > 1 else "127.0.0.1"
        # With trainer rank processes, rank 0 itself sends: the weights never pass through here.
        sender = RankZeroSender(self.trainer, ro.rpc_timeout_s) if hasattr(self.trainer, "send_weights") else None
        backend = self.plan.weight_backend if self.plan is not None else None
        broadcaster = WeightBroadcaster(host=host, backend=backend, timeout_s=ro.rpc_timeout_s, sender=sender)
        await broadcaster.open(engines)
        return broadcaster

    def close(self, engines: list[RolloutEngine], broadcaster: Optional[WeightBroadcaster]) -> None:
        """Stop every role: the weight group, the engines (live and dead), the reward
        service, the inference stage, trainer rank processes."""
        if broadcaster is not None:
            broadcaster.close()
        for engine in engines:  # engine servers stop together (each takes seconds), then are waited on
            if hasattr(engine, "request_shutdown"):
                try:
                    engine.request_shutdown()
                except Exception:  # noqa: BLE001 - a dead engine may fail to
                    pass
        for engine in engines:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - a dead engine may fail to
                pass
        if self.rewards is not None:
            self.rewards.close()
        if self.reference is not None:
            self.reference.close()
        if self.critic_stage is not None:
            self.critic_stage.close()
        if hasattr(self.trainer, "close"):  # trainer rank processes
            self.trainer.close()
