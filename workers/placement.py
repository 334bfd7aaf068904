"""Placement: which node, GPUs, GPU-memory share and CPU cores each process of a run gets.

Pure logic: :func:`plan_placement` takes the run spec (``resources``, ``rollout.engines``,
``schedule``) and a :class:`Machine` (what one node has) and returns a :class:`Plan`, or
raises :class:`PlacementError` saying what is short. :func:`detect_machine` describes the
machine this process runs on (torch.cuda, ``os.cpu_count()``); tests pass any machine.

Layouts:

- **CPU** (the machine has no GPU): each role runs where the cores are. When generation and
  training overlap (``schedule.mode: async`` or ``stream_train``) the engines get the first
  half of a node's cores and the trainer ranks the rest; otherwise (sync) each phase has
  the whole node. Within a role the cores are split into contiguous blocks, one per
  process, or shared by all when there are fewer cores than processes.
- **GPU, disaggregated** (default): on each node the trainer ranks take GPUs ``0..r-1`` and
  the engines the next ``tensor_parallel``-sized blocks, exclusively; vLLM takes 0.9 of an
  engine GPU's memory (``resources.gpu_memory_utilization``).
- **GPU, colocated** (``resources.colocate``, sync only): the engines share the trainer's
  GPUs, take a share of their memory (0.5 by default) and sleep while the trainer steps
  (``Plan.sleep_between_steps``).

On GPUs a node's cores are split evenly among the processes on it. Trainer ranks split
evenly over the nodes (rank r on node ``r // (ranks / nodes)``); engines are spread over
the nodes in contiguous, balanced groups (an engine never spans nodes).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional

if TYPE_CHECKING:
    from .spec import RunSpec

Role = Literal["trainer", "engine"]

ENGINE_GPU_MEMORY_UTILIZATION = 0.9  # an engine alone on its GPUs (vLLM's default)
COLOCATED_GPU_MEMORY_UTILIZATION = 0.5  # engines sharing GPUs with the trainer's weights and optimizer


class PlacementError(ValueError):
    """A run that does not fit the machine; the message names the spec field and what is short."""


@dataclass(frozen=True)
class Machine:
    """What one node has (all nodes of a run are assumed alike)."""
    cpu_cores: int = 1
    gpus_per_node: int = 0
    gpu_memory_gib: float = 0.0  # per GPU (the smallest, if they differ)

    def __post_init__(self):
        if self.cpu_cores < 1 or self.gpus_per_node < 0 or self.gpu_memory_gib < 0:
            raise ValueError(f"not a machine: {self}")


def detect_machine() -> Machine:
    """This host: ``os.cpu_count()`` cores and the GPUs torch sees (CUDA_VISIBLE_DEVICES applies)."""
    cores = os.cpu_count() or 1
    try:
        import torch
    except ImportError:
        return Machine(cpu_cores=cores)
    if not torch.cuda.is_available():
        return Machine(cpu_cores=cores)
    count = torch.cuda.device_count()
    memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(count)) / 2**30
    return Machine(cpu_cores=cores, gpus_per_node=count, gpu_memory_gib=round(memory, 1))


@dataclass(frozen=True)
class Process:
    """One process of the run. ``index``: the trainer's global rank, or the engine's index
    (0..rollout.engines-1). ``gpus``: node-local GPU ids it computes on.
    ``cuda_visible_devices``: what to set for it (None on CPU: leave the environment alone);
    a trainer rank sees all the trainer GPUs of its node and uses ``cuda:local_rank``, as
    DeepSpeed's launcher does; an engine sees exactly its ``tensor_parallel`` GPUs."""
    role: Role
    index: int
    node: int
    cpu_cores: tuple[int, ...]
    threads: int
    gpus: tuple[int, ...] = ()
    cuda_visible_devices: Optional[str] = None
    local_rank: Optional[int] = None  # trainer ranks only
    gpu_memory_utilization: Optional[float] = None  # engines on GPUs only

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}"

    @property
    def cpu_bind(self) -> str:
        return format_cores(self.cpu_cores)


@dataclass(frozen=True)
class Plan:
    device: Literal["cpu", "gpu"]
    nodes: int
    gpus_per_node: int  # GPUs the plan may use on each node (0 on CPU)
    tensor_parallel: int
    colocate: bool
    overlapped: bool  # generation and training run at once (async mode, or sync with stream_train)
    sleep_between_steps: bool  # engines sleep (free their GPU memory) while the trainer steps
    processes: tuple[Process, ...] = field(default_factory=tuple)

    @property
    def trainers(self) -> tuple[Process, ...]:
        return tuple(p for p in self.processes if p.role == "trainer")

    @property
    def engines(self) -> tuple[Process, ...]:
        return tuple(p for p in self.processes if p.role == "engine")

    def on_node(self, node: int, role: Optional[Role] = None) -> tuple[Process, ...]:
        return tuple(p for p in self.processes if p.node == node and role in (None, p.role))

    def cpu_bind(self, role: Role, node: int = 0) -> str:
        """The cores a role's processes on a node use between them, e.g. "0-3"."""
        return format_cores(self._cores(role, node))

    def threads(self, role: Role, node: int = 0) -> int:
        """Distinct cores a role has on a node: the threads it may run there in all."""
        return len(self._cores(role, node))

    def _cores(self, role: Role, node: int) -> list[int]:
        return sorted({c for p in self.on_node(node, role) for c in p.cpu_cores})

    def env(self, process: Process) -> dict[str, str]:
        """Environment variables that put a process where the plan says."""
        env = {"OMP_NUM_THREADS": str(process.threads)}
        if process.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = process.cuda_visible_devices
        if process.role == "trainer":
            env |= {"RANK": str(process.index), "LOCAL_RANK": str(process.local_rank or 0),
                    "WORLD_SIZE": str(len(self.trainers))}
        elif self.device == "cpu":
            env["VLLM_CPU_OMP_THREADS_BIND"] = process.cpu_bind
        return env

    def describe(self) -> str:
        lines = [f"{self.device} plan: {self.nodes} node(s)"
                 + (f" x {self.gpus_per_node} GPUs, {'colocated' if self.colocate else 'disaggregated'}"
                    if self.device == "gpu" else "")]
        for p in self.processes:
            where = f"node {p.node}, cores {p.cpu_bind} ({p.threads} threads)"
            if p.cuda_visible_devices is not None:
                where += f", CUDA_VISIBLE_DEVICES={p.cuda_visible_devices}"
            if p.gpu_memory_utilization is not None:
                where += f", gpu_memory_utilization={p.gpu_memory_utilization}"
            lines.append(f"  {p.name}: {where}")
        return "\n".join(lines)


def format_cores(cores) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8" (the cpuset syntax of taskset -c and VLLM_CPU_OMP_THREADS_BIND)."""
    cores = sorted(set(cores))
    parts, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            parts.append(str(start) if start == core else f"{start}-{core}")
            start = None
    return ",".join(parts)


# -- planning ---------------------------------------------------------------------------

def plan_placement(spec: "RunSpec", machine: Optional[Machine] = None) -> Plan:
    """The plan for a run on a machine (default: this one). GPUs are used when the machine
    has them; a spec that asks for GPUs on a machine without any is refused."""
    machine = machine or detect_machine()
    res = spec.resources
    if machine.gpus_per_node == 0:
        wanted = res.gpus or (res.gpus_per_node or 0) * res.nodes
        if wanted:
            name = "resources.gpus" if res.gpus else "resources.gpus_per_node"
            raise PlacementError(f"{name}: the run asks for {wanted} GPU(s), the machine has none")
        return plan_cpu(spec, machine)
    return plan_gpu(spec, machine)


def plan_cpu(spec: "RunSpec", machine: Machine) -> Plan:
    """The CPU layout (GPU counts in the spec are not consulted: the trainer and the engines
    run on cores). Async: half the cores for generation, the rest for training; sync:
    the whole machine for each phase (what the controller did before the planner)."""
    res = spec.resources
    if res.tensor_parallel > 1:
        raise PlacementError(f"resources.tensor_parallel: {res.tensor_parallel} shards an engine over GPUs; on a "
                             "CPU an engine runs unsharded (set it to 1)")
    ranks_per_node = _ranks_per_node(res.trainer_ranks, res.nodes)
    engines_per_node = _spread(spec.rollout.engines, res.nodes)
    overlapped = spec.schedule.mode == "async" or spec.schedule.stream_train
    cores = list(range(machine.cpu_cores))
    trainers, engines = [], []
    for node in range(res.nodes):
        n_engines = engines_per_node[node]
        if overlapped and n_engines and ranks_per_node and len(cores) >= 2:
            half = len(cores) // 2
            generation, training = cores[:half], cores[half:]
        else:
            generation = training = cores
        first_rank, first_engine = node * ranks_per_node, sum(engines_per_node[:node])
        for j, block in enumerate(_blocks(training, ranks_per_node)):
            trainers.append(Process("trainer", first_rank + j, node, block, len(block), local_rank=j))
        for j, block in enumerate(_blocks(generation, n_engines)):
            engines.append(Process("engine", first_engine + j, node, block, len(block)))
    return Plan("cpu", res.nodes, 0, 1, res.colocate, overlapped, False, tuple(trainers + engines))


def plan_gpu(spec: "RunSpec", machine: Machine) -> Plan:
    res = spec.resources
    nodes, tp, colocate = res.nodes, res.tensor_parallel, res.colocate
    if res.gpus_per_node is not None:
        per_node = res.gpus_per_node
        asked = f"resources.gpus_per_node: the run asks for {per_node} GPUs per node"
    elif res.gpus:
        per_node = res.gpus // nodes
        asked = f"resources.gpus: the run asks for {res.gpus} GPUs" + (f", {per_node} per node" if nodes > 1 else "")
    else:  # what the machine has
        per_node, asked = machine.gpus_per_node, ""
    if per_node > machine.gpus_per_node:
        raise PlacementError(f"{asked}, the machine has {machine.gpus_per_node}" + (" per node" if nodes > 1 else ""))
    ranks_per_node = _ranks_per_node(res.trainer_ranks, nodes)
    if tp > per_node:
        raise PlacementError(f"resources.tensor_parallel: an engine needs {tp} GPUs on one node, a node has "
                             f"{per_node} (an engine does not span nodes)")
    engines_per_node = _spread(spec.rollout.engines, nodes)
    for node, n_engines in enumerate(engines_per_node):
        engine_gpus = n_engines * tp
        need = max(ranks_per_node, engine_gpus) if colocate else ranks_per_node + engine_gpus
        if need > per_node:
            how = (f"colocated: trainer {ranks_per_node} and engines {n_engines}x{tp} share them" if colocate
                   else f"trainer {ranks_per_node} + engines {n_engines}x{tp}")
            raise PlacementError(f"resources: needs {need} GPUs on node {node} ({how}), the node has {per_node}; "
                                 "lower resources.trainer_ranks, rollout.engines or resources.tensor_parallel"
                                 + ("" if colocate else ", or set resources.colocate"))
    utilization = res.gpu_memory_utilization or (COLOCATED_GPU_MEMORY_UTILIZATION if colocate
                                                 else ENGINE_GPU_MEMORY_UTILIZATION)
    cores = list(range(machine.cpu_cores))
    trainers, engines = [], []
    for node in range(nodes):
        n_engines = engines_per_node[node]
        blocks = _blocks(cores, ranks_per_node + n_engines)  # every process on the node runs at once
        trainer_gpus = tuple(range(ranks_per_node))
        visible = ",".join(map(str, trainer_gpus))
        first_rank, first_engine = node * ranks_per_node, sum(engines_per_node[:node])
        for j in range(ranks_per_node):
            block = blocks[j]
            trainers.append(Process("trainer", first_rank + j, node, block, len(block), gpus=(j,),
                                    cuda_visible_devices=visible, local_rank=j))
        start = 0 if colocate else ranks_per_node
        for j in range(n_engines):
            gpus = tuple(range(start + j * tp, start + (j + 1) * tp))
            block = blocks[ranks_per_node + j]
            engines.append(Process("engine", first_engine + j, node, block, len(block), gpus=gpus,
                                   cuda_visible_devices=",".join(map(str, gpus)),
                                   gpu_memory_utilization=utilization))
    overlapped = spec.schedule.mode == "async" or spec.schedule.stream_train
    return Plan("gpu", nodes, per_node, tp, colocate, overlapped, colocate, tuple(trainers + engines))


def _ranks_per_node(ranks: int, nodes: int) -> int:
    if ranks % nodes:
        raise PlacementError(f"resources.trainer_ranks: {ranks} trainer rank(s) do not divide evenly over {nodes} "
                             "nodes (resources.nodes)")
    return ranks // nodes


def _spread(count: int, parts: int) -> list[int]:
    """count items over parts, balanced, the first parts taking the remainder: 5 over 2 -> [3, 2]."""
    return [count // parts + (1 if i < count % parts else 0) for i in range(parts)]


def _blocks(cores: list[int], count: int) -> list[tuple[int, ...]]:
    """count contiguous, balanced blocks of cores; all of them for each when there are fewer
    cores than blocks (the processes then share them)."""
    if count == 0:
        return []
    if len(cores) < count:
        return [tuple(cores)] * count
    sizes, out, start = _spread(len(cores), count), [], 0
    for size in sizes:
        out.append(tuple(cores[start:start + size]))
        start += size
    return out


# -- trainer memory ---------------------------------------------------------------------

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class TrainerMemory:
    """A trainer rank's static GPU memory in GiB (activations come on top)."""
    weights_gib: float
    gradients_gib: float
    optimizer_gib: float

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.gradients_gib + self.optimizer_gib


def trainer_memory(params: int, dtype: str, zero_stage: int, ranks: int) -> TrainerMemory:
    """Weights and gradients in the model's dtype; AdamW's two fp32 moments, plus an fp32
    master copy under bf16/fp16. ZeRO partitions over the ranks: stage 1 the optimizer
    state, 2 also the gradients, 3 also the weights."""
    size = DTYPE_BYTES[dtype]
    weights, gradients = params * size, params * size
    optimizer = params * (8 + (4 if size < 4 else 0))
    if zero_stage >= 1:
        optimizer /= ranks
    if zero_stage >= 2:
        gradients /= ranks
    if zero_stage >= 3:
        weights /= ranks
    return TrainerMemory(weights / 2**30, gradients / 2**30, optimizer / 2**30)


def check_trainer_memory(spec: "RunSpec", plan: Plan, machine: Machine, params: int) -> TrainerMemory:
    """Refuse a GPU plan whose trainer state cannot fit a GPU: all of it when disaggregated,
    what the engines leave (1 - gpu_memory_utilization) when colocated."""
    need = trainer_memory(params, spec.model.dtype, spec.trainer.zero_stage, len(plan.trainers))
    if plan.device != "gpu":
        return need
    share = 1.0 - plan.engines[0].gpu_memory_utilization if plan.colocate and plan.engines else 1.0
    budget = machine.gpu_memory_gib * share
    if need.total_gib > budget:
        raise PlacementError(
            f"trainer.zero_stage: a trainer rank needs {need.total_gib:.1f} GiB (weights {need.weights_gib:.1f} + "
            f"gradients {need.gradients_gib:.1f} + optimizer {need.optimizer_gib:.1f}, ZeRO stage "
            f"{spec.trainer.zero_stage} over {len(plan.trainers)} ranks), a GPU has {budget:.1f} GiB for it"
            + (" (what the colocated engines leave)" if share < 1 else "")
            + "; raise trainer.zero_stage or resources.trainer_ranks")
    return need
