"""Placement: which node, GPUs, GPU-memory share and CPU cores each process of a run gets.

Pure logic: :func:`plan_placement` takes the run spec (``resources``, ``rollout.engines``,
``schedule``) and a :class:`Machine` (what one node has) and returns a :class:`Plan`, or
raises :class:`PlacementError` saying what is short. :func:`detect_machine` describes the
machine this process runs on (torch.cuda, ``os.cpu_count()``, the inherited
``CUDA_VISIBLE_DEVICES``); tests pass any machine.

GPU ids in a plan (``Process.gpus``) are logical: 0..n-1 among the GPUs this process
sees. A worker may inherit a mask (Slurm, Docker ``--gpus``, ``CUDA_VISIBLE_DEVICES=4,5,6,7``):
the ids a child is given (``Process.cuda_devices``, ``Plan.env``) are the mask's entries
for those logical ids (ids or ``GPU-...`` UUIDs, passed as written), so a child lands on
the GPUs its parent was given. Every node is assumed to have the planner's mask.

GPU memory (workers/cluster/memory.py) is counted before anything starts when the
model's size is known (``plan_placement``'s ``model``, or the model folder at
``model.path``): a GPU that cannot hold what the plan puts on it refuses the run,
naming what is there. On a CPU plan each process's host memory is counted the same way
(workers/cluster/host_memory.py), and a node whose processes need more than it has refuses
the run.

Layouts:

- **CPU** (the machine has no GPU): each role runs where the cores are. When generation and
  training overlap (``schedule.mode: async`` or ``stream_train``) the engines get the first
  half of a node's cores and the trainer ranks the rest (``resources.cpu_overlap: split``), or
  both roles all of them, time-sliced by the operating system (``shared``); otherwise (sync)
  each phase has the whole node. Within a role the cores are split into contiguous blocks, one per
  process, or shared by all when there are fewer cores than processes. Each engine is a
  server process of its own started with its cores, as on GPUs, with vLLM inside it
  (``engine_single_process``); ``resources.engine_processes: false`` keeps them in the
  coordinator's process instead.
- **GPU, disaggregated** (default): on each node the trainer ranks take GPUs ``0..r-1`` and
  the engines the next ``tensor_parallel``-sized blocks, exclusively; vLLM takes 0.9 of an
  engine GPU's memory (``resources.gpu_memory_utilization``).
- **GPU, colocated** (``resources.colocate``): the engines share the trainer's GPUs and take a
  share of their memory (0.5 by default). In a sync schedule they sleep through each trainer
  step (vLLM sleep level 1: weights to host memory, the KV cache freed) and wake for the
  weight update, weights first. In an overlapped schedule (async, or stream_train) they never
  sleep: they generate beside the trainer's steps in their share and take in-flight updates,
  so the trainer's step must fit in what the share leaves. Either way the trainer's weights,
  gradients and optimizer states stay on the GPU beside the engines' share, so a colocated
  GPU plan needs the model's size. vLLM has sleep mode only on GPUs, and a CPU engine's
  memory is the host's: a CPU plan refuses colocation.

- **The inference stage on GPUs** (``reward.model``, ``algorithm.kl_reference: stage``,
  ``critic.forward: stage``): each worker is a process of its own on node 0, all on the GPU
  ``resources.inference_gpu`` names: trainer rank 0's (default), the first engine's (in what
  vLLM's share leaves) or one of their own after the trainer's and the engines'. The memory
  plan counts their models and forwards on it. On a CPU plan they run on the CPU, unbound.

On GPUs a node's cores are split evenly among the trainer and engine processes on it. Over
several nodes a disaggregated plan gives each role whole nodes where they fit (the trainer
the first nodes, the engines the rest); otherwise trainer ranks split evenly over the nodes
(rank r on node ``r // (ranks / nodes)``) and the engines are spread over them in
contiguous, balanced groups. An engine never spans nodes (:func:`_node_roles`).
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, Mapping, Optional

from workers.cluster.host_memory import HostMemoryPlan, host_memory_gib, plan_host_memory
from workers.cluster.memory import CRITIC_STAGE, REFERENCE_STAGE, REWARD_MODEL, MemoryPlan, plan_memory
from workers.cluster.model_size import DTYPE_BYTES, ModelSize, model_size
from workers.cluster.trainer_memory import TrainerMemory, trainer_memory
from workers.spec import PASSIVE_WAITS, model_dtype, shares_cores

if TYPE_CHECKING:
    from workers.spec import RunSpec

logger = logging.getLogger(__name__)

__all__ = ["CRITIC_STAGE", "DTYPE_BYTES", "INFERENCE_STAGES", "REFERENCE_STAGE", "REWARD_MODEL", "Machine", "MemoryPlan", "ModelSize", "PlacementError", "Plan", "Process", "TrainerMemory",
           "check_host_memory", "check_memory", "check_trainer_memory", "detect_machine", "format_cores",
           "inference_stages", "inherited_mask", "model_size",
           "plan_cpu", "plan_gpu", "plan_placement", "trainer_memory"]

Role = Literal["trainer", "engine", "inference"]

ENGINE_GPU_MEMORY_UTILIZATION = 0.9  # an engine alone on its GPUs (vLLM's default)
COLOCATED_GPU_MEMORY_UTILIZATION = 0.5  # engines sharing GPUs with the trainer's weights and optimizer


class PlacementError(ValueError):
    """A run that does not fit the machine; the message names the spec field and what is short."""


@dataclass(frozen=True)
class Machine:
    """What one node has (all nodes of a run are assumed alike). ``visible_devices``: the
    ``CUDA_VISIBLE_DEVICES`` entries the planning process inherited, logical id i being
    entry i (None: no mask, logical ids are the devices' own)."""
    cpu_cores: int = 1
    gpus_per_node: int = 0
    gpu_memory_gib: float = 0.0  # per GPU (the smallest, if they differ)
    visible_devices: Optional[tuple[str, ...]] = None
    host_memory_gib: float = 0.0  # per node (MemTotal); 0: unknown, CPU plans not memory-checked

    def __post_init__(self):
        if self.cpu_cores < 1 or self.gpus_per_node < 0 or self.gpu_memory_gib < 0 or self.host_memory_gib < 0 or (
                self.visible_devices is not None and len(self.visible_devices) < self.gpus_per_node):
            raise ValueError(f"not a machine: {self}")

    def device_id(self, gpu: int) -> str:
        """What CUDA_VISIBLE_DEVICES must name for a child to use logical GPU ``gpu``."""
        return self.visible_devices[gpu] if self.visible_devices is not None else str(gpu)


_DEVICE_ENTRY = re.compile(r"\d+|(?:GPU|MIG)-\S+")


def inherited_mask(env: Optional[Mapping[str, str]] = None) -> Optional[tuple[str, ...]]:
    """The ``CUDA_VISIBLE_DEVICES`` of ``env`` (default: this process's) as its entries:
    None when unset, () when set to nothing (no GPU). Like CUDA, the entries end at the
    first one that is neither an id nor a ``GPU-``/``MIG-`` UUID (``-1`` hides the rest)."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    entries = []
    for entry in value.split(","):
        entry = entry.strip()
        if not _DEVICE_ENTRY.fullmatch(entry):
            break
        entries.append(entry)
    return tuple(entries)


def detect_machine(env: Optional[Mapping[str, str]] = None) -> Machine:
    """This host: ``os.cpu_count()`` cores and the GPUs this process may use: those its
    inherited ``CUDA_VISIBLE_DEVICES`` names (none when it is empty), which the plan's
    ids are mapped through."""
    cores, host = os.cpu_count() or 1, host_memory_gib()
    mask = inherited_mask(env)
    if mask == ():
        return Machine(cpu_cores=cores, visible_devices=(), host_memory_gib=host)
    try:
        import torch
    except ImportError:
        return Machine(cpu_cores=cores, host_memory_gib=host)
    if not torch.cuda.is_available():
        return Machine(cpu_cores=cores, host_memory_gib=host)
    count = torch.cuda.device_count()  # torch applies the mask it saw when CUDA started
    if mask is not None:
        count = min(count, len(mask))
        mask = mask[:count]
    if count == 0:
        return Machine(cpu_cores=cores, visible_devices=mask, host_memory_gib=host)
    memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(count)) / 2**30
    return Machine(cpu_cores=cores, gpus_per_node=count, gpu_memory_gib=round(memory, 1), visible_devices=mask,
                   host_memory_gib=host)


@dataclass(frozen=True)
class Process:
    """One process of the run. ``index``: the trainer's global rank, or the engine's index
    (0..rollout.engines-1). ``gpus``: node-local logical GPU ids it computes on;
    ``cuda_devices``: the same GPUs as CUDA_VISIBLE_DEVICES must name them for a child
    (through the inherited mask: :meth:`Machine.device_id`).
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
    cuda_devices: tuple[str, ...] = ()  # per entry of gpus
    label: str = ""  # the inference stage's workers: which ("reward model", "KL reference stage", "critic stage")

    @property
    def name(self) -> str:
        return self.label or f"{self.role} {self.index}"

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
    processes: tuple[Process, ...] = field(default_factory=tuple)
    memory: Optional[MemoryPlan] = None  # GPU plans whose model size was known: what each GPU holds
    host_memory: Optional[HostMemoryPlan] = None  # CPU plans whose model size was known: what each process holds
    # Each rollout engine in a server process of its own: the default, and always on GPUs (only a
    # process of its own starts with the plan's CUDA_VISIBLE_DEVICES; engines inside the
    # coordinator would all land on its first visible GPU, each asking for its memory share of it).
    engine_processes: bool = True
    shared_cores: bool = False  # resources.cpu_overlap shared: overlapped roles on the same cores wait passively

    @property
    def trainers(self) -> tuple[Process, ...]:
        return tuple(p for p in self.processes if p.role == "trainer")

    @property
    def engines(self) -> tuple[Process, ...]:
        return tuple(p for p in self.processes if p.role == "engine")

    def inference(self, label: str) -> Optional[Process]:
        """The inference stage's worker ``label`` (:data:`INFERENCE_STAGES`) on a GPU plan, None
        where it is not placed (a CPU plan: the worker runs on the CPU, unbound)."""
        return next((p for p in self.processes if p.role == "inference" and p.label == label), None)

    def engine_single_process(self, setting: Optional[bool]) -> bool:
        """rollout.cpu_single_process for its engines: by default vLLM runs inside a CPU
        engine server's own process (no engine core or worker process to spin-wait; the
        server shares no interpreter lock with the trainer); not inside the coordinator,
        not with tensor_parallel > 1 (vLLM's mp executor), not on GPUs."""
        if setting is not None:
            return setting
        return self.device == "cpu" and self.engine_processes and self.tensor_parallel == 1

    @property
    def sleeps(self) -> bool:
        """Its engines sleep (vLLM sleep mode) through every trainer step: colocated GPU plans of a
        sync schedule. Colocated engines of an overlapped one generate beside the step instead."""
        return self.device == "gpu" and self.colocate and not self.overlapped

    @property
    def weight_backend(self) -> str:
        """The trainer->engine weight group's backend, by placement: NCCL only when trainer
        rank 0 and every engine worker compute on a GPU of their own (NCCL refuses two
        members on one device: colocated plans share them), gloo through host memory
        otherwise."""
        if self.device != "gpu":
            return "gloo"
        members = [(p.node, p.cuda_devices[0] if p.cuda_devices else None) for p in self.trainers if p.index == 0]
        members += [(p.node, d) for p in self.engines for d in p.cuda_devices]
        own = all(d is not None for _, d in members) and len(set(members)) == len(members)
        return "nccl" if own else "gloo"

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
        env |= PASSIVE_WAITS if self.shared_cores else {}  # no thread spinning on the other role's cores
        if process.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = process.cuda_visible_devices
        if process.role == "trainer":
            env |= {"RANK": str(process.index), "LOCAL_RANK": str(process.local_rank or 0),
                    "WORLD_SIZE": str(len(self.trainers))}
        elif self.device == "cpu":  # one core list per tensor-parallel worker, "|" between them
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                format_cores(block) for block in _blocks(list(process.cpu_cores), self.tensor_parallel))
        return env

    def node_roles(self) -> list[str]:
        """What each node holds, runs of alike nodes together: "  nodes 0-15: trainer ranks 0-127
        (8 a node)", "  nodes 16-31: engines 0-31 (2 a node, tensor_parallel 4)"."""
        def kinds(node):
            return (len(self.on_node(node, "trainer")), len(self.on_node(node, "engine")))

        lines, node = [], 0
        while node < self.nodes:
            last = node
            while last + 1 < self.nodes and kinds(last + 1) == kinds(node):
                last += 1
            ranks, engines = kinds(node)
            span = [p for n in range(node, last + 1) for p in self.on_node(n) if p.role != "inference"]
            parts = []
            for role, count, what in (("trainer", ranks, "trainer ranks"), ("engine", engines, "engines")):
                if count:
                    idx = [p.index for p in span if p.role == role]
                    parts.append(f"{what} {idx[0]}-{idx[-1]}" if len(idx) > 1 else f"{what[:-1]} {idx[0]}")
                    if last > node:
                        parts[-1] += f" ({count} a node)"
            where = f"nodes {node}-{last}" if last > node else f"node {node}"
            lines.append(f"  {where}: " + ("; ".join(parts) or "nothing"))
            node = last + 1
        return lines

    def describe(self) -> str:
        lines = [f"{self.device} plan: {self.nodes} node(s)"
                 + (f" x {self.gpus_per_node} GPUs, {'colocated' if self.colocate else 'disaggregated'}"
                    if self.device == "gpu" else "")]
        lines += self.node_roles()
        for p in self.processes:
            where = f"node {p.node}, cores {p.cpu_bind} ({p.threads} threads)"
            if p.cuda_visible_devices is not None:
                where += f", CUDA_VISIBLE_DEVICES={p.cuda_visible_devices}"
            if p.gpu_memory_utilization is not None:
                where += f", gpu_memory_utilization={p.gpu_memory_utilization}"
            lines.append(f"  {p.name}: {where}")
        if self.device == "gpu":
            if self.sleeps:
                lines.append("  colocated engines sleep while the trainer steps (vLLM sleep level 1: weights to host "
                             "memory, KV cache freed), and wake for the weight update and generation")
            elif self.colocate:
                lines.append("  colocated engines generate beside the trainer's steps in their memory share "
                             "(gpu_memory_utilization) and take in-flight updates; they never sleep")
            lines += self.memory.describe() if self.memory else ["  GPU memory not checked (model size unknown)"]
        elif self.host_memory is not None:
            lines += self.host_memory.describe()
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

def plan_placement(spec: "RunSpec", machine: Optional[Machine] = None, model: Optional[ModelSize] = None) -> Plan:
    """The plan for a run on a machine (default: this one). GPUs are used when the machine
    has them; a spec that asks for GPUs on a machine without any is refused. On GPUs the
    memory is checked (:func:`check_memory`) with ``model``'s size, by default the model
    folder's at ``model.path`` (the controller has resolved it by then); a GPU plan whose
    model size is unknown is not checked, except that colocation is refused. On the CPU
    each process's host memory is (:func:`check_host_memory`)."""
    machine = machine or detect_machine()
    res = spec.resources
    if machine.gpus_per_node == 0:
        wanted = res.gpus or (res.gpus_per_node or 0) * res.nodes
        if wanted:
            name = "resources.gpus" if res.gpus else "resources.gpus_per_node"
            raise PlacementError(f"{name}: the run asks for {wanted} GPU(s), the machine has none")
        return check_host_memory(spec, plan_cpu(spec, machine), machine, model)
    plan = plan_gpu(spec, machine)
    model = model or model_size(spec.model.path, spec.model.lora)
    if model is None:
        if plan.colocate:
            raise PlacementError(
                f"resources.colocate: the size of model.path {spec.model.path!r} is unknown (no model folder "
                "there), so the planner cannot check that the trainer's states and the engines' share fit a GPU "
                "together while the engines generate")
        logger.debug("GPU memory not checked: the size of model.path %r is unknown", spec.model.path)
        return plan
    memory = check_memory(spec, plan, machine, model, _reward_model_size(spec))
    return replace(plan, memory=memory)


def _reward_model_size(spec: "RunSpec") -> Optional[ModelSize]:
    if spec.reward.model is None:
        return None
    return model_size(spec.reward.model.path, head="sequence-classification")  # a folder by now (resolved)


def check_host_memory(spec: "RunSpec", plan: Plan, machine: Machine, model: Optional[ModelSize] = None) -> Plan:
    """``plan`` (a CPU plan) with what each of its processes holds in host memory
    (workers/cluster/host_memory.py), for ``model``'s size (default: model.path's); a node whose
    processes need more than ``machine.host_memory_gib`` refuses the run (PlacementError naming
    each process and what lowers it), unless FLUXRL_SKIP_HOST_MEMORY_CHECK=1. Unknown model
    size: the plan as it is."""
    model = model or model_size(spec.model.path, spec.model.lora)
    if model is None:
        logger.debug("host memory not planned: the size of model.path %r is unknown", spec.model.path)
        return plan
    host = plan_host_memory(spec, plan, model, machine.host_memory_gib, _reward_model_size(spec))
    problem = host.problem()
    if problem and os.environ.get("FLUXRL_SKIP_HOST_MEMORY_CHECK") != "1":
        raise PlacementError(problem + " (FLUXRL_SKIP_HOST_MEMORY_CHECK=1 starts it anyway)")
    if problem:
        logger.warning("%s; started anyway (FLUXRL_SKIP_HOST_MEMORY_CHECK=1)", problem)
    return replace(plan, host_memory=host)


def plan_cpu(spec: "RunSpec", machine: Machine) -> Plan:
    """The CPU layout (GPU counts in the spec are not consulted: the trainer and the engines
    run on cores). Async: half the cores for generation, the rest for training; sync:
    the whole machine for each phase (what the controller did before the planner)."""
    res = spec.resources
    tp = res.tensor_parallel
    if tp > 1 and (res.engine_processes is False or spec.rollout.cpu_single_process):
        raise PlacementError(f"resources.tensor_parallel: {tp} shards an engine over {tp} worker processes of "
                             "vLLM's own (its mp executor), which an engine inside the coordinator's process "
                             "cannot have: leave resources.engine_processes and rollout.cpu_single_process out")
    if res.colocate:
        raise PlacementError("resources.colocate: colocated engines sleep while the trainer steps, and vLLM has sleep "
                             "mode only on GPUs (CUDA, ROCm, XPU); on a CPU, schedule.mode 'sync' already gives each "
                             "phase the whole machine: leave it out")
    ranks_per_node = _ranks_per_node(res.trainer_ranks, res.nodes)
    engines_per_node = _spread(spec.rollout.engines, res.nodes)
    overlapped = spec.schedule.mode == "async" or spec.schedule.stream_train
    cores = list(range(machine.cpu_cores))
    trainers, engines = [], []
    for node in range(res.nodes):
        n_engines = engines_per_node[node]
        if overlapped and res.cpu_overlap == "split" and n_engines and ranks_per_node and len(cores) >= 2:
            half = len(cores) // 2
            generation, training = cores[:half], cores[half:]
        else:
            generation = training = cores
        first_rank, first_engine = node * ranks_per_node, sum(engines_per_node[:node])
        for j, block in enumerate(_blocks(training, ranks_per_node)):
            trainers.append(Process("trainer", first_rank + j, node, block, len(block), local_rank=j))
        for j, block in enumerate(_blocks(generation, n_engines)):
            engines.append(Process("engine", first_engine + j, node, block, len(block)))
    return Plan("cpu", res.nodes, 0, tp, res.colocate, overlapped, tuple(trainers + engines),
                engine_processes=res.engine_processes is not False or res.nodes > 1,
                shared_cores=shares_cores(spec))


def plan_gpu(spec: "RunSpec", machine: Machine) -> Plan:
    res = spec.resources
    if res.engine_processes is False:
        raise PlacementError("resources.engine_processes false on GPUs: engines inside the coordinator's process "
                             "cannot be given their own GPUs (CUDA_VISIBLE_DEVICES is read once, at process start), "
                             "so every one would land on the first visible GPU. Leave it out: on GPUs each engine "
                             "is a process of its own")
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
    if tp > per_node:
        raise PlacementError(f"resources.tensor_parallel: an engine needs {tp} GPUs on one node, a node has "
                             f"{per_node} (an engine does not span nodes)")
    ranks_on, engines_on = _node_roles(res.trainer_ranks, spec.rollout.engines, nodes, per_node, tp, colocate)
    utilization = res.gpu_memory_utilization or (COLOCATED_GPU_MEMORY_UTILIZATION if colocate
                                                 else ENGINE_GPU_MEMORY_UTILIZATION)
    cores = list(range(machine.cpu_cores))
    trainers, engines = [], []
    for node in range(nodes):
        n_ranks, n_engines = ranks_on[node], engines_on[node]
        blocks = _blocks(cores, n_ranks + n_engines)  # every process on the node runs at once
        trainer_gpus = tuple(range(n_ranks))
        visible = ",".join(machine.device_id(g) for g in trainer_gpus)
        first_rank, first_engine = sum(ranks_on[:node]), sum(engines_on[:node])
        for j in range(n_ranks):
            block = blocks[j]
            trainers.append(Process("trainer", first_rank + j, node, block, len(block), gpus=(j,),
                                    cuda_visible_devices=visible, local_rank=j,
                                    cuda_devices=(machine.device_id(j),)))
        start = 0 if colocate else n_ranks
        for j in range(n_engines):
            gpus = tuple(range(start + j * tp, start + (j + 1) * tp))
            devices = tuple(machine.device_id(g) for g in gpus)
            block = blocks[n_ranks + j]
            engines.append(Process("engine", first_engine + j, node, block, len(block), gpus=gpus,
                                   cuda_visible_devices=",".join(devices), gpu_memory_utilization=utilization,
                                   cuda_devices=devices))
    stages = _inference_stages(spec, machine, ranks_on[0], engines_on[0], tp, per_node, colocate)
    overlapped = spec.schedule.mode == "async" or spec.schedule.stream_train
    return Plan("gpu", nodes, per_node, tp, colocate, overlapped, tuple(trainers + engines + stages),
                engine_processes=True)


def _node_roles(ranks: int, engines: int, nodes: int, per_node: int, tp: int,
                colocate: bool) -> tuple[list[int], list[int]]:
    """(trainer ranks, engines) on each node of a GPU plan. The rule:

    - **Whole-node roles** when they fit: a disaggregated plan over several nodes gives the
      trainer the first ``ceil(ranks / GPUs per node)`` nodes, its ranks split evenly over them,
      and the engines the remaining nodes (balanced, contiguous), as AReaL and StreamRL lay
      large runs out: the trainer's ZeRO collectives span the fewest nodes, and no node splits
      its GPUs and NICs between training and generation. Preferred whenever it fits.
    - **An even split** otherwise: every node runs ``ranks / nodes`` trainer ranks and its share
      of the engines (colocated plans, one node, or where the roles do not fill whole nodes).

    Neither fitting: the even split's refusal, which names the node and its GPUs."""
    if not colocate and nodes > 1 and ranks and engines:
        trainer_nodes = -(-ranks // per_node)
        engine_nodes = nodes - trainer_nodes
        if engine_nodes >= 1 and ranks % trainer_nodes == 0:
            spread = _spread(engines, engine_nodes)
            if spread[0] * tp <= per_node:
                return ([ranks // trainer_nodes] * trainer_nodes + [0] * engine_nodes,
                        [0] * trainer_nodes + spread)
    ranks_per_node = _ranks_per_node(ranks, nodes)
    engines_per_node = _spread(engines, nodes)
    for node, n_engines in enumerate(engines_per_node):
        engine_gpus = n_engines * tp
        need = max(ranks_per_node, engine_gpus) if colocate else ranks_per_node + engine_gpus
        if need > per_node:
            how = (f"colocated: trainer {ranks_per_node} and engines {n_engines}x{tp} share them" if colocate
                   else f"trainer {ranks_per_node} + engines {n_engines}x{tp}")
            raise PlacementError(f"resources: needs {need} GPUs on node {node} ({how}), the node has {per_node}; "
                                 "lower resources.trainer_ranks, rollout.engines or resources.tensor_parallel"
                                 + ("" if colocate else ", or set resources.colocate"))
    return [ranks_per_node] * nodes, engines_per_node


INFERENCE_STAGES = (REWARD_MODEL, REFERENCE_STAGE, CRITIC_STAGE)


def inference_stages(spec: "RunSpec") -> list[str]:
    """The inference stage's workers a run starts (each a process of its own beside the coordinator)."""
    return [label for label, used in ((REWARD_MODEL, spec.reward.model is not None),
                                      (REFERENCE_STAGE, spec.algorithm.kl_reference == "stage"),
                                      (CRITIC_STAGE, spec.critic.forward == "stage")) if used]


def _inference_stages(spec: "RunSpec", machine: Machine, ranks: int, engines: int, tp: int, per_node: int,
                      colocate: bool) -> list[Process]:
    """The inference stage's workers on node 0, all on the GPU ``resources.inference_gpu``
    names: trainer rank 0's, the first engine's, or one of their own after both."""
    labels = inference_stages(spec)
    if not labels:
        return []
    where = spec.resources.inference_gpu
    if where == "trainer":
        gpu = 0
    elif where == "engine":
        if not engines:
            raise PlacementError("resources.inference_gpu 'engine': node 0 runs no engine, so the inference stage "
                                 "(" + ", ".join(labels) + ") has no engine GPU to share; use 'trainer' or 'own'")
        gpu = 0 if colocate else ranks
    else:
        gpu = max(ranks, engines * tp) if colocate else ranks + engines * tp
        if gpu >= per_node:
            raise PlacementError(f"resources.inference_gpu 'own': node 0 has {per_node} GPUs and the trainer and "
                                 f"the engines take {gpu}, so none is left for the inference stage ("
                                 + ", ".join(labels) + "); use 'trainer' or 'engine', or give the run one GPU more")
    threads = {REWARD_MODEL: spec.reward.model.threads if spec.reward.model else 1}
    cores = tuple(range(machine.cpu_cores))  # not bound: they run between the trainer's and engines' bursts
    return [Process("inference", i, 0, cores, threads.get(label, spec.inference.threads), gpus=(gpu,),
                    cuda_visible_devices=machine.device_id(gpu), cuda_devices=(machine.device_id(gpu),), label=label)
            for i, label in enumerate(labels)]


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


# -- memory (workers/cluster/memory.py) ----------------------------------------------------

def check_memory(spec: "RunSpec", plan: Plan, machine: Machine, model: ModelSize,
                 reward_model: Optional[ModelSize] = None) -> Optional[MemoryPlan]:
    """What each GPU of ``plan`` holds for a model of ``model``'s size (and reward.model's,
    ``reward_model``, when known); a GPU that cannot hold it refuses the run (PlacementError
    naming the GPU, every item on it and what would lower the largest). CPU plans: None
    (:func:`check_host_memory` counts their host memory)."""
    if plan.device != "gpu":
        return None
    memory = plan_memory(spec, plan, machine.gpu_memory_gib, model, reward_model)
    problem = memory.problem()
    if problem:
        raise PlacementError(problem)
    return memory


def check_trainer_memory(spec: "RunSpec", plan: Plan, machine: Machine, params: int) -> TrainerMemory:
    """A trainer rank's memory for a model of ``params`` parameters; a GPU plan that does
    not fit is refused (:func:`check_memory`, which counts everything on each GPU)."""
    check_memory(spec, plan, machine, ModelSize(params))
    return trainer_memory(params, model_dtype(spec, on_gpu=plan.device == "gpu"), spec.trainer.zero_stage, len(plan.trainers))
