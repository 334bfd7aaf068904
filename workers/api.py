"""The engine's declared contracts: what the controller, its schedules and the weight
transport call on a trainer and on a rollout engine, what a trainer gives the engines,
how a weight update travels, and the environment of agentic RL. One module to read to
know what any implementation must offer; ``make_trainer`` and ``make_engines`` pick the
implementation a run's plan calls for.

Protocols (structural: an implementation does not inherit them):

- ``TrainEngine``: a trainer (``train.trainer.Trainer`` in this process,
  ``train.ranks.TrainerGroup`` of rank processes, ``train.pipeline_trainer.PipelineTrainer``
  of pipeline stages, ``cluster.node.ClusterTrainer`` over several nodes). Capabilities
  only some have are Protocols of their own: ``StreamTrainEngine`` (a synchronous step
  streamed in micro-batches), ``CriticTrainEngine`` (the critic's weights, for the critic
  stage), ``WeightGroupHost`` (global rank 0 hosts the collective weight group),
  ``TrainerProcesses`` (processes of its own to report and stop).
- ``WeightWriter``: how a trainer writes the weights the engines load (weights/files.py).
- ``InferenceEngine``: a rollout engine (``rollout.engine.RolloutEngine`` in this process,
  ``rollout.client.EngineClient`` for an engine server, ``rollout.pool.TenantEngine`` and
  ``rollout.pool.PoolClient`` for a run's place on a shared engine pool).
- ``WeightUpdate``: the weight-update descriptor (weights/update.py).
- ``Environment``: an agentic environment (agents/api.py).

tests/test_contracts.py checks every implementation's methods against these signatures,
and mypy (tests/test_types.py) checks the assignments at the end of this module.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Mapping, Optional, Protocol, Sequence

from workers.agents.api import Environment
from workers.weights.files import WeightFile, WeightWriter
from workers.weights.update import BroadcastWeights, FileWeights, InlineWeights, WeightUpdate

if TYPE_CHECKING:
    import torch

    from workers.cluster.placement import Plan
    from workers.rollout.engine_types import Completion, UpdateTiming
    from workers.rollout.messages import EngineServerConfig
    from workers.spec import RunSpec
    from workers.train.samples import TrainSample

__all__ = ["BroadcastWeights", "CriticTrainEngine", "Environment", "FileWeights", "InferenceEngine", "InlineWeights",
           "StreamTrainEngine", "TrainEngine", "TrainerProcesses", "WeightFile", "WeightGroupHost", "WeightUpdate",
           "WeightWriter", "make_engines", "make_trainer", "trainer_threads", "trainer_devices"]


# -- trainers -----------------------------------------------------------------------------------
class TrainEngine(WeightWriter, Protocol):
    """A trainer as the controller, its schedules and its checkpoints use it."""

    @property
    def version(self) -> int:
        """The policy version: the optimiser steps taken (a resumed run's included)."""

    def train_step(self, batch: list[TrainSample]) -> dict[str, float]:
        """One step on the whole batch (the asynchronous schedule); the step's statistics."""

    def state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """The policy's full tensors on the CPU (None on a node that does not hold them)."""

    def save(self, path: str) -> None:
        """A Hugging Face folder of the policy that vLLM and transformers load."""

    def save_state(self, folder: str) -> None:
        """Everything a resumed run needs (weights, optimiser, scheduler) into ``folder``."""

    def load_state(self, folder: str) -> int:
        """Restore ``save_state``'s folder; the policy version it holds."""


class StreamTrainEngine(TrainEngine, Protocol):
    """A synchronous step streamed: each group's micro-batches as soon as it is scored."""

    def begin_step(self) -> None: ...

    def accumulate(self, batch: list[TrainSample], denominator: float = 1.0, last: bool = False) -> None: ...

    def finish_step(self, sequences: int, rescale: bool = False) -> dict[str, float]: ...


class CriticTrainEngine(Protocol):
    """critic.forward stage: the trainer critic's weights, for the stage's copy."""

    def critic_state_dict(self) -> Optional[dict[str, torch.Tensor]]: ...


class WeightGroupHost(Protocol):
    """Trainer rank 0 hosts the collective weight group itself (weights/broadcast.py
    ``RankZeroSender``): the weights never pass through the coordinator."""

    def host_weight_group(self, host: str, world: int, backend: str, timeout_s: float) -> dict[str, Any]: ...

    def form_weight_group(self) -> None: ...

    def prepare_weights(self, version: int, bucket_bytes: int) -> Optional[dict[str, Any]]: ...

    def send_weights(self) -> Optional[str]: ...

    def leave_weight_group(self) -> None: ...


class TrainerProcesses(Protocol):
    """A trainer in processes of its own: their pids (memory peaks) and stopping them."""

    @property
    def pids(self) -> list[int]: ...

    def close(self) -> None: ...


# -- rollout engines ----------------------------------------------------------------------------
class InferenceEngine(Protocol):
    """A rollout engine as the fleet (coord/generation.py), the controller and the weight
    transport use it. Generation returns ``Completion``s with behaviour log-probs and
    each token's policy version; a sequence the engine could not finish comes back as
    ``handed_off`` or ``engine_died`` with its tokens so far."""

    @property
    def index(self) -> int: ...

    @property
    def update_mode(self) -> str:
        """rollout.update_mode: keep, interrupt or drain."""

    @property
    def max_model_len(self) -> int:
        """Prompt + completion tokens one sequence may hold (an episode's turns fit in it)."""

    @property
    def generated_tokens(self) -> int: ...

    @property
    def updates(self) -> list[UpdateTiming]:
        """Its weight updates whose generation stall is still being measured."""

    @property
    def version(self) -> int:
        """The policy version of the weights it holds."""

    @property
    def active(self) -> Mapping[Any, float]:
        """One key per running sequence (its count is the engine's load)."""

    @property
    def busy_s(self) -> float:
        """Seconds with at least one request running, up to the last finished stretch."""

    @property
    def worker_count(self) -> int:
        """Its vLLM workers: the ranks it takes in a weight group."""

    @property
    def dead(self) -> bool: ...

    async def start(self, weights: Optional[WeightUpdate] = None, version: int = 0) -> None: ...

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float,
                       seed: Optional[int] = None, ignore_eos: bool = False, priority: int = 0) -> Completion: ...

    async def generate_group(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                             seed: Optional[int] = None, ignore_eos: bool = False,
                             priority: int = 0) -> list[Completion]: ...

    def stream_group(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                     seed: Optional[int] = None, ignore_eos: bool = False,
                     priority: int = 0) -> AsyncIterator[tuple[int, Completion]]: ...

    async def hand_off(self, count: int) -> int: ...

    async def update_weights(self, weights: WeightUpdate, version: int) -> UpdateTiming: ...

    async def join_weight_group(self, info: dict[str, Any]) -> list[int]: ...

    async def weights_checksum(self) -> Optional[str]: ...

    async def sleep(self) -> float: ...

    async def wake_up(self, tags: Optional[list[str]] = None) -> float: ...

    def busy_seconds(self, now: Optional[float] = None) -> float: ...

    def core_pids(self) -> list[int]: ...

    def shutdown(self) -> None: ...


# -- the factory: which implementation a run's plan calls for -----------------------------------
def trainer_threads(plan: Plan, node: int = 0) -> int | list[int]:
    """Threads of each trainer rank process on ``node``: on GPUs each rank's own, as the
    plan says (OMP_NUM_THREADS); on the CPU the node's trainer cores shared out."""
    ranks = plan.on_node(node, "trainer")
    if plan.device == "gpu":
        return [p.threads for p in ranks]
    return max(1, plan.threads("trainer", node) // len(ranks))


def trainer_devices(plan: Plan, node: int = 0) -> Optional[list[str]]:
    """The GPUs of ``node``'s trainer ranks: the plan's logical ids, mapped through the mask
    this worker inherited (None on the CPU)."""
    ranks = plan.on_node(node, "trainer")
    return [p.cuda_devices[0] for p in ranks] if plan.device == "gpu" else None


def make_trainer(spec: RunSpec, plan: Plan, pad_id: int) -> TrainEngine:
    """The trainer of a run on one node (a run over several nodes joins their agents first:
    coord/processes.py builds its ``ClusterTrainer``): RLHFuse's fused actor-critic
    pipeline (trainer.pipeline.stages > 1), DeepSpeed ranks in processes of their own
    (resources.trainer_ranks > 1 or trainer_process), else DeepSpeed in this process."""
    from workers.cluster.placement import PlacementError

    res = spec.resources
    if spec.trainer.pipeline.stages > 1:
        if plan.device != "cpu":  # its stages pass activations through gloo, in host memory
            raise PlacementError("trainer.pipeline.stages > 1: the fused actor-critic pipeline passes each "
                                 "micro-batch's activations between its stage processes over gloo in host "
                                 "memory and trains in fp32 without DeepSpeed: it is built for CPU stage "
                                 "processes, and neither the planner nor its stages place it on GPUs; on GPUs "
                                 "leave trainer.pipeline.stages at 1 (DeepSpeed's trainer)")
        from workers.train.pipeline_trainer import PipelineTrainer

        return PipelineTrainer(spec, spec.model.path, plan.threads("trainer"), pad_id)
    if res.nodes > 1:
        raise ValueError("a trainer over several nodes is formed at the rendezvous (Processes.start_trainer)")
    if res.trainer_ranks > 1 or res.trainer_process:  # DeepSpeed ranks, each a process of its own
        from workers.train.ranks import TrainerGroup

        return TrainerGroup(spec, spec.model.path, res.trainer_ranks, trainer_threads(plan), pad_id,
                            cuda_devices=trainer_devices(plan))
    from workers.train.trainer import Trainer

    return Trainer(spec, spec.model.path, plan.threads("trainer") if plan.device == "cpu" else None, pad_id)


def make_engines(spec: RunSpec, configs: Sequence[EngineServerConfig], in_process: bool,
                 remote: Optional[Mapping[int, tuple[str, int]]] = None) -> list[InferenceEngine]:
    """The run's rollout engines, not started, one per configuration: its places on this
    node's shared engine pools (rollout.share_engines), engine servers (started here, or
    ``remote``: index -> (address, pid) a node agent started), or engines in this process
    (``in_process``: a CPU plan without engine processes)."""
    if spec.rollout.share_engines:
        from workers.rollout.pool_client import PoolClient, tenant_info

        lora = spec.model.lora
        if lora is None or not configs:
            raise ValueError("rollout.share_engines: runs share engines through their LoRA adapters (model.lora)")
        c = configs[0]
        tenant = tenant_info(spec.name, lora.rank, c.update_mode, c.top_p, c.top_k, list(c.stop),
                             list(c.stop_token_ids), group_size=spec.algorithm.group_size)
        return [PoolClient(config, tenant) for config in configs]
    if not in_process:
        from workers.rollout.client import EngineClient

        where = remote or {}
        return [EngineClient(config, *where.get(config.index, (None, None))) for config in configs]
    from workers.rollout.engine import RolloutEngine

    return [RolloutEngine.from_config(config) for config in configs]


# -- what the type checker holds every implementation to ----------------------------------------
if TYPE_CHECKING:
    from workers.cluster.node import ClusterTrainer
    from workers.rollout.client import EngineClient
    from workers.rollout.engine import RolloutEngine
    from workers.rollout.pool import TenantEngine
    from workers.rollout.pool_client import PoolClient
    from workers.train.pipeline_trainer import PipelineTrainer
    from workers.train.ranks import TrainerGroup
    from workers.train.trainer import Trainer

    _trainers: Sequence[Callable[..., TrainEngine]] = (Trainer, TrainerGroup, PipelineTrainer, ClusterTrainer)
    _streaming: Sequence[Callable[..., StreamTrainEngine]] = (Trainer, TrainerGroup, ClusterTrainer)
    _critics: Sequence[Callable[..., CriticTrainEngine]] = (Trainer, TrainerGroup, PipelineTrainer)
    _hosts: Sequence[Callable[..., WeightGroupHost]] = (TrainerGroup, ClusterTrainer)
    _processes: Sequence[Callable[..., TrainerProcesses]] = (TrainerGroup, PipelineTrainer, ClusterTrainer)
    _engines: Sequence[Callable[..., InferenceEngine]] = (RolloutEngine, EngineClient, TenantEngine, PoolClient)
