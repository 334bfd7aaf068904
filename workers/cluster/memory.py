"""GPU memory of a placement plan, counted before anything starts.

:func:`plan_memory` lays what each process of a GPU plan holds on each GPU it uses and
:meth:`MemoryPlan.problem` names the first GPU that overflows (None when all fit);
``workers/cluster/placement.py`` raises it as a ``PlacementError``. Pure arithmetic
over the spec, the plan and the model's size (:func:`model_size`: the exact parameter
count from the model's ``config.json``, instantiated on torch's meta device). What is
counted, per GPU, and where it comes from:

- **Trainer rank** (:func:`trainer_memory`: DeepSpeed 0.19.8 under the config
  ``workers.train.deepspeed_setup.deepspeed_config`` gives it, torch AdamW): weights, gradients,
  the fp32 master copy and Adam's two moments, partitioned as ZeRO does (stage 1 the
  master copy and moments, 2 also the gradients, 3 also the weights), and the largest of
  the transients: the fp32 gradients flattened at the optimizer step, under ZeRO-3 the
  largest module's weights gathered for a weight sync (``Trainer.state_dict`` gathers one
  module's own parameters at a time), under autocast the low-precision weight copies the forward keeps
  for the backward.
- **KL reference** (``algorithm.kl_coef > 0``, in the trainer): a full copy on every trainer
  GPU, in the dtype the policy was loaded in (fp32 under autocast; ``Trainer.__init__`` moves
  it to the rank's device, ZeRO never shards it).
- **The inference stage's workers** (``reward.model``, ``kl_reference: stage``,
  ``critic.forward: stage``; :func:`inference_items`), on the GPU ``resources.inference_gpu``
  names: a CUDA context each (``STAGE_RUNTIME_GIB``, estimated), the model (the reference and
  the critic's copy as the trainer loads them, the reward model in its folder's dtype) and,
  while the rollout generates, one no-grad forward of ``inference.micro_batch_tokens`` tokens
  (:func:`inference_forward_gib`; the reference's with its full-vocabulary logits).
- **Engine** (vLLM): ``gpu_memory_utilization`` x the GPU's memory, all of it: vLLM
  requests that share at start-up and sizes its KV cache to fill what its weights
  (split over ``tensor_parallel``) and activations leave of it
  (vllm/v1/worker/utils.py ``request_memory``, gpu_worker.py ``determine_available_memory``).
  Anything else on that GPU must fit in the rest. The weights must leave room in the
  share, and with ``rollout.max_model_len`` set, room for one such sequence's KV cache
  (what vLLM's v1/core/kv_cache_utils.py ``_check_enough_kv_cache_memory`` demands).
- **Weight-receive buffers** (``rollout.weight_transport: collective``, outside vLLM's
  share): ``WeightGroup.receive_stream`` posts the next bucket while the current one is
  copied into the parameters, so an engine GPU holds two buckets at a time, each
  ``weight_group.BUCKET_BYTES`` or the largest tensor, whichever is larger (a tensor larger
  than a bucket travels alone). ``rpc`` receives in host memory.

Colocated plans (the engines on the trainer's GPUs) are counted in two phases, since the
engines sleep through each trainer step (vLLM sleep level 1: weights to host memory, KV
cache freed; ``RolloutEngine.sleep``): *generating* (the trainer's weights, gradients and
optimizer states, the reference, and the engines' share) and *training* (the trainer's
all, transients included, and the reference; the engines hold nothing), and between the
two *updating* (the engines' weights awake, their KV cache still asleep, the receive
buffers; the trainer's persistent states and, under ZeRO-3, its largest module gathered).

Also per trainer rank: its **CUDA context and runtime buffers** (cuBLAS, NCCL, DeepSpeed's
buckets: ``RUNTIME_GIB``, measured), the **critic** (``algorithm.advantage: gae``: a second
model with its own DeepSpeed engine at ``critic.zero_stage``), and, as the largest transient
beside the optimizer step's and ZeRO-3's gather, the **largest micro-batch's activations and
its logits at the full vocabulary** (:func:`forward_memory`: what autograd keeps of each layer,
by architecture and precision, and the logits' peak with the entropy and, with top-p/top-k,
the truncation; the forward is ``trainer.micro_batch_tokens``, or the longest sequence where
that is longer: :func:`forward_tokens`). Each term is checked within 15% of what a real HF
forward and backward keeps on the CPU at a 100k vocabulary and 2,048 tokens
(``tests/workers/cluster/test_forward_calibration.py``), and the rank's total within 25% of
the peaks measured on an H200 (docs/benchmarks.md, "On a GPU"; ``test_memory_plan.py``).

Not counted (they come on top): the critic's own activations (its forward and backward
come after the policy's), the trainer's send buckets (a few x 32 MiB), what a sleeping
engine keeps (its CUDA context and graphs). vLLM's sampling buffers and activations are
inside its share (it profiles them at start-up).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from workers.cluster.model_size import DTYPE_BYTES, GIB, ModelSize
from workers.cluster.trainer_memory import (RUNTIME_GIB, TrainerMemory, inference_forward_gib, reference_adapter_params,
                                            run_trainer_memory, trainer_forward_gib, trainer_holds_reference,
                                            trainer_memory, trainer_precision)
from workers.spec import model_dtype
from workers.weights.weight_group import BUCKET_BYTES

if TYPE_CHECKING:
    from workers.spec import RunSpec

# The inference stage's workers, by the names the plan, the logs and result.json give them
REWARD_MODEL, REFERENCE_STAGE, CRITIC_STAGE = "reward model", "KL reference stage", "critic stage"
# An inference stage's worker (plain torch, no NCCL or DeepSpeed): its CUDA context and
# cuBLAS workspace. Estimated, not measured: no such worker has run on a GPU yet.
STAGE_RUNTIME_GIB = 0.8


# -- a whole plan ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    """One thing on a GPU: ``owner`` (``trainer rank 0``, ``engine 1``), ``what``, GiB,
    and ``kind`` (what would lower it: trainer, reference, engine, receive)."""
    owner: str
    what: str
    gib: float
    kind: str


@dataclass(frozen=True)
class GpuLoad:
    node: int
    gpu: int  # the plan's node-local id
    items: tuple[Item, ...]
    phase: str = ""  # colocated plans: "generating", "updating" or "training" (engines asleep through the step)

    @property
    def total_gib(self) -> float:
        return sum(i.gib for i in self.items)

    def listing(self) -> str:
        """"trainer rank 0 weights 13.0, gradients 13.0; engine 0 ..." (GiB)."""
        owners = dict.fromkeys(i.owner for i in self.items)
        return "; ".join(owner + " " + ", ".join(f"{i.what} {i.gib:.1f}" for i in self.items if i.owner == owner)
                         for owner in owners)


@dataclass(frozen=True)
class MemoryPlan:
    """Per GPU of a GPU plan, what it holds (:class:`Item`), and the engines' own check
    (their weights within their share); :meth:`problem` says what does not fit."""
    gpu_memory_gib: float
    gpus: tuple[GpuLoad, ...]
    trainer: TrainerMemory
    engine_weights_gib: float  # per engine GPU (weights / tensor_parallel)
    engine_share_gib: float  # gpu_memory_utilization x a GPU's memory
    kv_cache_gib: float  # what an engine's share leaves for the KV cache and activations, per GPU
    kv_needed_gib: Optional[float]  # one rollout.max_model_len sequence's KV cache per GPU, when known
    hints: tuple[tuple[str, str], ...] = ()  # (item kind, the spec fields that lower it)
    colocate: bool = False

    def problem(self) -> Optional[str]:
        if self.engine_share_gib and self.kv_cache_gib <= 0:
            return (f"resources.gpu_memory_utilization: an engine's weights take {self.engine_weights_gib:.1f} GiB "
                    f"per GPU, its share of a GPU is {self.engine_share_gib:.1f} GiB: nothing is left for the KV "
                    "cache; raise resources.gpu_memory_utilization or resources.tensor_parallel")
        if self.kv_needed_gib is not None and self.kv_cache_gib < self.kv_needed_gib:
            return (f"rollout.max_model_len: one sequence's KV cache takes {self.kv_needed_gib:.1f} GiB per GPU, an "
                    f"engine's share leaves {self.kv_cache_gib:.1f} GiB after its weights (activations come on "
                    "top); lower rollout.max_model_len, or raise resources.gpu_memory_utilization or "
                    "resources.tensor_parallel")
        for load in self.gpus:
            total = load.total_gib
            if total <= self.gpu_memory_gib:
                continue
            top = max(load.items, key=lambda i: i.gib)
            kinds = {i.kind for i in load.items}
            hints = [hint for kind, hint in self.hints if kind in kinds]
            return (f"resources: GPU {load.gpu} of node {load.node} needs {total:.1f} GiB"
                    + {"generating": " while the engines generate",
                       "updating": " while the engines take the weight update (their KV cache asleep)",
                       "training": " while the trainer steps (the engines asleep)", "": ""}[load.phase]
                    + f", it has {self.gpu_memory_gib:.1f}: {load.listing()}. The largest is {top.owner}'s "
                    f"{top.what}." + (" To fit: " + "; ".join(hints) if hints else ""))
        return None

    def describe(self) -> list[str]:
        lines = [f"  GPU {load.gpu} of node {load.node}" + (f", {load.phase}" if load.phase else "")
                 + f": {load.total_gib:.1f} of {self.gpu_memory_gib:.1f} GiB ({load.listing()})" for load in self.gpus]
        if self.engine_share_gib:
            lines.append(f"  an engine's share per GPU: {self.engine_share_gib:.1f} GiB, its weights "
                         f"{self.engine_weights_gib:.1f}, left for the KV cache and activations "
                         f"{self.kv_cache_gib:.1f}")
        return lines


def inference_items(spec: "RunSpec", p, model: ModelSize, reward_model: Optional[ModelSize], dtype: str,
                    forwarding: bool) -> list[Item]:
    """What an inference stage's worker (``p``, role "inference") holds on its GPU: a CUDA
    context, its model (the KL reference and the critic's copy in the trainer's load dtype,
    the reward model in its folder's), and while the rollout generates (``forwarding``) a
    forward of ``inference.micro_batch_tokens`` tokens (the workers split micro-batches to that)."""
    stage = spec.trainer.zero_stage
    tokens = spec.inference.micro_batch_tokens
    items = [Item(p.name, "CUDA context (estimated)", STAGE_RUNTIME_GIB, "inference")]
    if p.label == REWARD_MODEL:
        if reward_model is None:
            return items + [Item(p.name, "model (size unknown: not counted)", 0.0, "inference")]
        rm_bytes = DTYPE_BYTES[reward_model.saved_dtype or "float32"]
        items.append(Item(p.name, "reward model", reward_model.params * rm_bytes / GIB, "inference"))
        forward = inference_forward_gib(reward_model, tokens, rm_bytes, logits=False, sort=False)
    else:
        reference = p.label == REFERENCE_STAGE
        held = model.params + (reference_adapter_params(spec, model) if reference else 0)
        weights = trainer_memory(held, dtype, stage, 1).reference_gib  # fp32 under autocast, else lp
        act = 4 if trainer_precision(dtype, stage) == "fp32" else DTYPE_BYTES[dtype]
        items.append(Item(p.name, "reference model" if reference else "critic's copy", weights, "inference"))
        truncated = spec.rollout.top_p < 1 or spec.rollout.top_k > 0
        forward = inference_forward_gib(model, tokens, act, logits=reference, sort=truncated)
    if forwarding and forward:
        items.append(Item(p.name, f"a forward of {tokens} tokens", forward, "inference"))
    return items


def plan_memory(spec: "RunSpec", plan, gpu_memory_gib: float, model: ModelSize,
                reward_model: Optional[ModelSize] = None) -> MemoryPlan:
    """What each GPU of ``plan`` (a GPU ``workers.cluster.placement.Plan``, not imported: the
    planner imports this module) holds on GPUs of ``gpu_memory_gib``; see the module's
    docstring for each item. ``reward_model``: the size of reward.model's folder, if known."""
    dtype, stage, ranks = model_dtype(spec, on_gpu=True), spec.trainer.zero_stage, len(plan.trainers)
    lp = DTYPE_BYTES[dtype]
    model_gib = model.params * lp / GIB  # what the engines hold and receive: the weights in the model's dtype
    trainer = run_trainer_memory(spec, model, dtype, ranks)
    critic = (trainer_memory(model.params, dtype, spec.critic.zero_stage, ranks)
              if spec.algorithm.advantage == "gae" else None)  # the trainer trains it, wherever it values
    tokens, activations, logits = trainer_forward_gib(spec, model, dtype)
    forward_gib = trainer.cast_gib + activations + logits
    forward_what = (f"a micro-batch's forward of {tokens} tokens (activations {activations:.1f}, full-vocabulary "
                    f"logits {logits:.1f}"
                    + (f", autocast's weight copies {trainer.cast_gib:.1f}" if trainer.cast_gib else "") + ")")
    reference = trainer_holds_reference(spec)
    collective = spec.rollout.weight_transport == "collective"
    receive_gib = 2 * max(BUCKET_BYTES, (model.largest or 0) * lp) / GIB
    capacity = gpu_memory_gib
    # phase -> (node, gpu) -> items; colocated engines sleep through the trainer's step; colocated
    # engines of an overlapped schedule never sleep: their share and the trainer's step add up
    phases = ("generating", "updating", "training") if plan.sleeps else ("",)
    loads: dict[str, dict[tuple[int, int], list[Item]]] = {phase: {} for phase in phases}
    share = 0.0
    for phase in phases:
        for p in plan.processes:
            owner = f"trainer rank {p.index}" if p.role == "trainer" else p.name
            for gpu in p.gpus:
                items = loads[phase].setdefault((p.node, gpu), [])
                if p.role == "inference":  # forwards while the rollout generates, weights always
                    items += inference_items(spec, p, model, reward_model, dtype, phase in ("", "generating"))
                elif p.role == "trainer":
                    items += [Item(owner, "CUDA context and runtime buffers (measured)", RUNTIME_GIB[stage], "runtime"),
                              Item(owner, "weights", trainer.weights_gib, "trainer"),
                              Item(owner, "gradients", trainer.gradients_gib, "trainer"),
                              Item(owner, "fp32 master weights and Adam states" if trainer.master else "Adam states",
                                   trainer.optimizer_gib, "trainer")]
                    if critic is not None:
                        items.append(Item(owner, "critic's weights, gradients and optimizer states",
                                          critic.weights_gib + critic.gradients_gib + critic.optimizer_gib, "critic"))
                    what, gib = trainer.transient
                    if forward_gib > gib:
                        what, gib = forward_what, forward_gib
                    if phase == "updating":  # ZeRO-3 gathers each module in turn to send them
                        what, gib = "largest module gathered for a weight sync (ZeRO-3)", trainer.gather_gib
                    if gib and phase != "generating":
                        items.append(Item(owner, what, gib, "forward" if what == forward_what else "trainer"))
                    if reference:
                        items.append(Item(owner, "KL reference model", trainer.reference_gib, "reference"))
                elif phase == "updating":  # the weights awake, the KV cache still asleep
                    items.append(Item(owner, "weights (awake for the update)", model_gib / plan.tensor_parallel,
                                      "engine"))
                    if collective:
                        items.append(Item(owner, "weight-receive buffers (collective transport, 2 buckets)",
                                          receive_gib, "receive"))
                elif phase != "training":
                    share = p.gpu_memory_utilization * capacity
                    items.append(Item(owner, f"vLLM share (gpu_memory_utilization {p.gpu_memory_utilization:g})",
                                      share, "engine"))
                    if collective:
                        items.append(Item(owner, "weight-receive buffers (collective transport, 2 buckets)",
                                          receive_gib, "receive"))
    tp = plan.tensor_parallel
    engine_weights = model_gib / tp if plan.engines else 0.0
    kv_needed = None
    if plan.engines and model.kv_values_per_token and spec.rollout.max_model_len:
        kv_needed = model.kv_values_per_token * lp * spec.rollout.max_model_len / tp / GIB
    zero_hint = (f"raise trainer.zero_stage (now {stage}) or resources.trainer_ranks (now {ranks})" if stage < 3
                 else f"raise resources.trainer_ranks (now {ranks}, ZeRO-3)")
    hints = (("trainer", zero_hint),
             ("forward", f"lower trainer.micro_batch_tokens (now {spec.trainer.micro_batch_tokens})"
                         + ("" if spec.trainer.gradient_checkpointing else " or set trainer.gradient_checkpointing")),
             ("critic", f"raise critic.zero_stage (now {spec.critic.zero_stage})"),
             ("reference", "set algorithm.kl_coef 0 (its reference model is a full copy on every trainer GPU)"),
             ("engine", "lower resources.gpu_memory_utilization" + (", or set resources.colocate false"
                                                                      if plan.colocate else "")),
             ("receive", "set rollout.weight_transport rpc (it receives the weights in host memory)"),
             ("inference", f"lower inference.micro_batch_tokens (now {spec.inference.micro_batch_tokens}) or move "
                           f"the inference stage (resources.inference_gpu, now '{spec.resources.inference_gpu}')"))
    gpus = tuple(GpuLoad(node, gpu, tuple(items), phase) for phase in phases
                 for (node, gpu), items in sorted(loads[phase].items()))
    return MemoryPlan(capacity, gpus, trainer, engine_weights, share, share - engine_weights if plan.engines else 0.0,
                      kv_needed, hints, plan.sleeps)
