"""Host memory of a CPU plan, per process, counted before anything starts.

On a CPU plan every process's states live in the host's memory, and a plan that needs more
than the machine has ends with the kernel's OOM killer, minutes in and with no word of why
(Qwen2.5-0.5B's shape in float32 on a 24 GB machine, for one). :func:`plan_host_memory`
gives each process of the plan (named as ``result.json``'s ``memory_peak_gib`` names it) its
items; :meth:`HostMemoryPlan.problem` refuses a plan whose processes on a node need more than
its memory. The arithmetic of the states is the GPU planner's (``workers/cluster/memory.py``);
what differs on the CPU:

- **Each process's own runtime** (the interpreter, torch, transformers, DeepSpeed or vLLM):
  measured, as the peaks of a run of the tiny model (whose states are 0.01 GiB) on this
  machine (2 cores, torch 2.13 CPU, vLLM 0.32, DeepSpeed 0.19.8): ``*_RUNTIME_GIB``.
- **A trainer** (in the coordinator, or a process per rank): the policy's weights, gradients
  and optimizer states, the critic's and the KL reference as :func:`trainer_memory` counts
  them in ``model.dtype`` (``auto`` is float32 on the CPU), and the largest transient: the
  optimizer step's, a micro-batch's forward (activations, full-vocabulary logits, autocast's
  weight copies; :func:`forward_memory`) or, under ZeRO-3, a weight sync's: the largest module
  gathered and, on rank 0, the whole model's copy that ``Trainer.state_dict`` builds from the
  gathered modules in host memory.
- **A vLLM engine core**: its KV cache, which vLLM's CPU backend allocates whole
  (``VLLM_CPU_KVCACHE_SPACE``: ``rollout.kv_cache_gb`` rounded, at least 1), the weights
  twice (the tensors, and the checkpoint's pages it maps while loading them: 1.9x measured)
  and the first weight update's copy (vLLM's layerwise reload builds each layer anew: 1.9x
  the weights measured above the level before it). With ``resources.tensor_parallel`` > 1
  these spread over vLLM's worker processes, whose peaks are listed apart.
- **An engine server**: its runtime (weight updates pass through it in bounded frames,
  spooled to disk).
- **The inference stage's workers** (``reward.model``, ``kl_reference: stage``,
  ``critic.forward: stage``): their runtime, model and one forward of
  ``inference.micro_batch_tokens`` tokens (:func:`inference_forward_gib`).

Checked against the measured peaks of ``examples/own-model/real-size.yaml`` (within 25% of
each process: ``tests/workers/test_real_size.py``, ``pytest -m scale``). Not counted: the
fused pipeline's stage processes (``trainer.pipeline.stages`` > 1), the page cache.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from workers.cluster.memory import CRITIC_STAGE, REFERENCE_STAGE, REWARD_MODEL, Item
from workers.cluster.model_size import DTYPE_BYTES, GIB, ModelSize
from workers.cluster.trainer_memory import (inference_forward_gib, reference_adapter_params, run_trainer_memory,
                                            trainer_forward_gib, trainer_holds_reference, trainer_memory,
                                            trainer_precision)
from workers.spec import model_dtype

if TYPE_CHECKING:
    from workers.spec import RunSpec

logger = logging.getLogger(__name__)

# Peaks of each kind of process in a 3-step run of the tiny model on this machine
# (2026-11-28; resident memory, Linux VmHWM).
COORDINATOR_RUNTIME_GIB = 0.53  # the coordinator without a trainer (trainer_process: true)
TRAINER_RUNTIME_GIB = 0.24  # what a trainer adds to its process: 0.77 with it in the coordinator, a rank 0.74
ENGINE_SERVER_RUNTIME_GIB = 0.71
VLLM_CORE_RUNTIME_GIB = 0.82  # 1.82 with its 1 GiB KV cache
INFERENCE_WORKER_RUNTIME_GIB = 0.54  # the KL reference stage's worker
# vLLM's core holds its weights about twice while it loads them, and builds them anew
# for the first weight update (both 1.9x measured with Qwen2.5-0.5B's shape in bfloat16).
VLLM_LOAD_COPIES = 2
VLLM_FIRST_UPDATE_COPIES = 2


@dataclass(frozen=True)
class ProcessLoad:
    """One process: its name (``coordinator``, ``trainer rank 1``, ``engine 0 server``,
    ``engine 0 vLLM core``, ``KL reference stage``), its node and what it holds."""
    name: str
    node: int
    items: tuple[Item, ...]

    @property
    def total_gib(self) -> float:
        return sum(i.gib for i in self.items)


@dataclass(frozen=True)
class HostMemoryPlan:
    processes: tuple[ProcessLoad, ...]
    host_memory_gib: float  # per node; 0: unknown (not checked)
    hints: tuple[str, ...] = ()

    def by_process(self) -> dict[str, float]:
        """{process name: planned peak GiB}, as result.json's ``memory_plan_gib``."""
        return {p.name: round(p.total_gib, 2) for p in self.processes}

    def node_total_gib(self, node: int) -> float:
        return sum(p.total_gib for p in self.processes if p.node == node)

    def problem(self) -> Optional[str]:
        if not self.host_memory_gib:
            return None
        for node in sorted({p.node for p in self.processes}):
            total = self.node_total_gib(node)
            if total <= self.host_memory_gib:
                continue
            procs = [p for p in self.processes if p.node == node]
            listing = "; ".join(f"{p.name} {p.total_gib:.1f}" for p in procs)
            top = max((i for p in procs for i in p.items), key=lambda i: i.gib)
            return (f"resources: node {node}'s processes need {total:.1f} GiB of host memory, it has "
                    f"{self.host_memory_gib:.1f} ({listing}). The largest item is {top.owner}'s {top.what} "
                    f"({top.gib:.1f}). To fit: " + "; ".join(self.hints))
        return None

    def describe(self) -> list[str]:
        lines = []
        for p in self.processes:
            parts = ", ".join(f"{i.what} {i.gib:.2f}" for i in p.items)
            lines.append(f"  {p.name}: {p.total_gib:.1f} GiB of host memory ({parts})")
        nodes = sorted({p.node for p in self.processes})
        for node in nodes:
            of = f" of {self.host_memory_gib:.1f}" if self.host_memory_gib else ""
            lines.append(f"  node {node}: {self.node_total_gib(node):.1f}{of} GiB planned in all")
        return lines


def trainer_items(spec: "RunSpec", model: ModelSize, ranks: int, dtype: str, owner: str,
                  keeps_copy: bool = True) -> list[Item]:
    """A trainer rank's states (the policy's, the critic's, the KL reference) and its largest
    transient, on the host. ``keeps_copy``: the rank whose ZeRO-3 weight sync keeps the gathered
    copy (rank 0; the others take part in the gather and keep nothing)."""
    stage = spec.trainer.zero_stage
    mem = run_trainer_memory(spec, model, dtype, ranks)
    items = [Item(owner, "weights", mem.weights_gib, "trainer"),
             Item(owner, "gradients", mem.gradients_gib, "trainer"),
             Item(owner, "fp32 master weights and Adam states" if mem.master else "Adam states",
                  mem.optimizer_gib, "trainer")]
    if spec.algorithm.advantage == "gae":
        critic = trainer_memory(model.params, dtype, spec.critic.zero_stage, ranks)
        items.append(Item(owner, "critic's weights, gradients and optimizer states",
                          critic.weights_gib + critic.gradients_gib + critic.optimizer_gib, "critic"))
    if trainer_holds_reference(spec):
        items.append(Item(owner, "KL reference model", mem.reference_gib, "reference"))
    _, activations, logits = trainer_forward_gib(spec, model, dtype)
    what, gib = mem.transient
    if stage == 3 and keeps_copy and mem.gather_gib:  # the state dict fills up in host memory
        sync = mem.gather_gib + model.params * DTYPE_BYTES[dtype] / GIB
        if sync > gib:
            what, gib = "a weight sync's copy of the model and its largest module gathered (ZeRO-3)", sync
    if mem.cast_gib + activations + logits > gib:
        what, gib = "a micro-batch's forward", mem.cast_gib + activations + logits
    items.append(Item(owner, what, gib, "forward"))
    return items


def engine_core_items(spec: "RunSpec", model: ModelSize, dtype: str, owner: str) -> list[Item]:
    kv = max(1, int(round(spec.rollout.kv_cache_gb)))  # as configure_cpu_environment sets it
    weights = model.params * DTYPE_BYTES[dtype] / GIB
    return [Item(owner, "vLLM runtime (measured)", VLLM_CORE_RUNTIME_GIB, "runtime"),
            Item(owner, "KV cache (VLLM_CPU_KVCACHE_SPACE)", float(kv * spec.resources.tensor_parallel), "engine"),
            Item(owner, "weights, as loaded", VLLM_LOAD_COPIES * weights, "engine"),
            Item(owner, "the first weight update's copy", VLLM_FIRST_UPDATE_COPIES * weights, "engine")]


def inference_worker_items(spec: "RunSpec", label: str, model: ModelSize, reward_model: Optional[ModelSize],
                           dtype: str) -> list[Item]:
    tokens = spec.inference.micro_batch_tokens
    items = [Item(label, "runtime (measured)", INFERENCE_WORKER_RUNTIME_GIB, "runtime")]
    if label == REWARD_MODEL:
        if reward_model is None:
            return items
        rm_bytes = DTYPE_BYTES[reward_model.saved_dtype or "float32"]
        return items + [Item(label, "reward model", reward_model.params * rm_bytes / GIB, "inference"),
                        Item(label, f"a forward of {tokens} tokens",
                             inference_forward_gib(reward_model, tokens, rm_bytes, logits=False, sort=False),
                             "inference")]
    stage = spec.trainer.zero_stage
    act = 4 if trainer_precision(dtype, stage) == "fp32" else DTYPE_BYTES[dtype]
    reference = label == REFERENCE_STAGE
    truncated = spec.rollout.top_p < 1 or spec.rollout.top_k > 0
    held = model.params + (reference_adapter_params(spec, model) if reference else 0)  # model.lora.init's
    return items + [Item(label, "reference model" if reference else "critic's copy",
                         trainer_memory(held, dtype, stage, 1).reference_gib, "inference"),
                    Item(label, f"a forward of {tokens} tokens",
                         inference_forward_gib(model, tokens, act, logits=reference, sort=truncated), "inference")]


def plan_host_memory(spec: "RunSpec", plan, model: ModelSize, host_memory_gib: float = 0.0,
                     reward_model: Optional[ModelSize] = None) -> HostMemoryPlan:
    """What each process of the CPU ``plan`` (``workers.cluster.placement.Plan``) holds in host
    memory, for a model of ``model``'s size; nodes of ``host_memory_gib`` (0: not checked)."""
    dtype, res = model_dtype(spec, on_gpu=False), spec.resources
    ranks = len(plan.trainers)
    in_process = spec.trainer.pipeline.stages == 1 and res.nodes == 1 and ranks == 1 and not res.trainer_process
    coordinator = [Item("coordinator", "runtime (measured)", COORDINATOR_RUNTIME_GIB, "runtime")]
    if in_process:
        coordinator += [Item("coordinator", "trainer runtime (measured)", TRAINER_RUNTIME_GIB, "runtime")]
        coordinator += trainer_items(spec, model, ranks, dtype, "coordinator")
    processes = [ProcessLoad("coordinator", 0, tuple(coordinator))]
    if not in_process and spec.trainer.pipeline.stages == 1:
        for p in plan.trainers:
            name = f"trainer rank {p.index}"
            processes.append(ProcessLoad(name, p.node, tuple(
                [Item(name, "runtime (measured)", COORDINATOR_RUNTIME_GIB + TRAINER_RUNTIME_GIB, "runtime")]
                + trainer_items(spec, model, ranks, dtype, name, keeps_copy=p.index == 0))))
    for p in plan.engines:
        if plan.engine_processes:
            name = f"engine {p.index} server"
            processes.append(ProcessLoad(name, p.node, (Item(name, "runtime (measured)", ENGINE_SERVER_RUNTIME_GIB,
                                                             "runtime"),)))
        name = f"engine {p.index} vLLM core"
        processes.append(ProcessLoad(name, p.node, tuple(engine_core_items(spec, model, dtype, name))))
    stages = {REWARD_MODEL: spec.reward.model is not None,
              REFERENCE_STAGE: spec.algorithm.kl_coef > 0 and spec.algorithm.kl_reference == "stage",
              CRITIC_STAGE: spec.algorithm.advantage == "gae" and spec.critic.forward == "stage"}
    for label, present in stages.items():
        if present:
            processes.append(ProcessLoad(label, 0, tuple(inference_worker_items(spec, label, model, reward_model,
                                                                                dtype))))
    hints = []
    if dtype == "float32":
        hints.append("set model.dtype bfloat16 (the trainer keeps fp32 master weights and Adam states either way; "
                     "the engines and the forward's activations halve)")
    hints += [f"lower trainer.micro_batch_tokens (now {spec.trainer.micro_batch_tokens})",
              f"lower rollout.kv_cache_gb (now {spec.rollout.kv_cache_gb:g})",
              "or run on a machine with more memory (the trainer's states alone are "
              f"{sum(i.gib for i in trainer_items(spec, model, max(1, ranks), dtype, '')[:3]):.1f} GiB)"]
    return HostMemoryPlan(tuple(processes), host_memory_gib, tuple(hints))


def host_memory_gib() -> float:
    """This machine's memory (``MemTotal``), GiB; 0 where unreadable."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return 0.0
