"""RLHFuse's intra-stage fusion: the actor's and the critic's training as two pipelines
over the same ranks in opposite directions, one schedule filling each pipeline's bubbles
with the other's micro-batches.

- **Stages.** A Hugging Face decoder (a base model with ``embed_tokens``, ``layers`` and
  ``norm``: the Llama, Qwen2 and Mistral families) is split by layers into ``stages``
  contiguous parts. Each part runs the base model's own forward over its layers
  (``inputs_embeds`` past the first part), so the masks and rotary positions are the
  model's. The actor (the policy with its LM head) has stage s on rank s; the critic (the
  value model, ``workers/train/critic.py``) has stage s on rank ``stages-1-s``, so its
  first stage shares a rank with the actor's last.
- **Work.** Each model's loss over the micro-batches: decoupled PPO for the actor, the
  clipped value loss for the critic (the trainer's own functions, one optimiser step per
  batch). A micro-batch's activations go forward, their gradients backward, between ranks
  over gloo point-to-point messages.
- **Schedules.** ``sequential``: the actor's 1F1B pipeline, then the critic's, as two
  pipelines run one after the other. ``fused``: both interleaved on every rank, in an
  order simulated ahead (``fused_schedule``): with a forward taking 1 unit and a backward
  2, a free rank takes the ready operation of either model that can start first (a
  backward before a forward). A greedy list schedule: RLHFuse searches its fused schedule
  with simulated annealing.
- **Tied embeddings.** An actor whose LM head is its embedding holds that matrix on its
  first and last stage; their gradients are summed before the step.

The rank processes live in workers/train/pipeline_group.py: ``PipelineGroup`` keeps them
across steps (the trainer of a run with ``trainer.pipeline.stages`` ≥ 2,
workers/train/pipeline_trainer.py); ``run_step`` measures one step's wall time and bubble
share (a rank idle, waiting for another) and returns the gradients (tests compare them with
the unsplit models'). bench/fused_pipeline.py measures both schedules.
"""
from __future__ import annotations

import copy
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from workers.tasks.model_folder import check_model_folder


MODELS = ("actor", "critic")


# -- schedules (pure) ---------------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    kind: str  # "F" (forward) or "B" (backward)
    model: str  # "actor" or "critic"
    micro: int


def stage_of(model: str, rank: int, stages: int) -> int:
    """The stage of ``model`` on ``rank`` (and, the map being its own inverse, the rank of a stage)."""
    return rank if model == "actor" else stages - 1 - rank


def split_layers(layers: int, stages: int) -> list[range]:
    """Contiguous layer ranges, as even as can be, the earlier stages taking the extra ones."""
    if not 1 <= stages <= layers:
        raise ValueError(f"{layers} layers cannot make {stages} pipeline stages")
    base, extra = divmod(layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def one_f_one_b(stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """One stage's order in the 1F1B pipeline: ``stages-1-stage`` forwards to fill the pipe,
    then a forward and a backward in turn, then the remaining backwards."""
    warm = min(stages - 1 - stage, micro)
    ops = [("F", m) for m in range(warm)]
    for i in range(micro - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", m) for m in range(micro - warm, micro)]


def sequential_schedule(stages: int, micro: int) -> list[list[Op]]:
    """Every rank: its actor stage's 1F1B order, then its critic stage's."""
    return [[Op(k, "actor", m) for k, m in one_f_one_b(stage_of("actor", r, stages), stages, micro)]
            + [Op(k, "critic", m) for k, m in one_f_one_b(stage_of("critic", r, stages), stages, micro)]
            for r in range(stages)]


def _depends_on(op: Op, rank: int, stages: int) -> Optional[tuple]:
    """The operation of another rank that ``op`` waits for: the previous stage's forward, or
    the next stage's backward (key: kind, model, stage, micro)."""
    stage = stage_of(op.model, rank, stages)
    if op.kind == "F" and stage > 0:
        return ("F", op.model, stage - 1, op.micro)
    if op.kind == "B" and stage < stages - 1:
        return ("B", op.model, stage + 1, op.micro)
    return None


def simulate(schedule: list[list[Op]], forward: float = 1.0, backward: float = 2.0,
             choose: bool = False) -> tuple[list[list[Op]], float, list[float]]:
    """Run ``schedule`` (one op list per rank) on an ideal machine: an op starts when its rank
    is free and what it waits for is done. ``choose``: each rank's list is split by model
    into two queues and a free rank takes the head that can start first (a backward before a
    forward, the actor before the critic). Returns the order each rank ran, the makespan and
    each rank's busy share."""
    stages = len(schedule)
    queues = [{m: deque(op for op in ops if op.model == m) for m in MODELS} if choose else {"all": deque(ops)}
              for ops in schedule]
    done: dict[tuple, float] = {}
    free = [0.0] * stages
    busy = [0.0] * stages
    order: list[list[Op]] = [[] for _ in range(stages)]
    while any(q for qs in queues for q in qs.values()):
        best = None
        for r in range(stages):
            for q in queues[r].values():
                if not q:
                    continue
                op = q[0]
                dep = _depends_on(op, r, stages)
                if dep is not None and dep not in done:
                    continue
                start = max(free[r], done.get(dep, 0.0))
                key = (start, op.kind != "B", op.model != "actor", r)
                if best is None or key < best[0]:
                    best = (key, r, q)
        if best is None:
            raise RuntimeError("the schedule deadlocks: every rank waits for an operation not yet run")
        (start, *_), r, q = best
        op = q.popleft()
        cost = forward if op.kind == "F" else backward
        free[r] = start + cost
        busy[r] += cost
        done[(op.kind, op.model, stage_of(op.model, r, stages), op.micro)] = start + cost
        order[r].append(op)
    makespan = max(free)
    return order, makespan, [b / makespan for b in busy]


def fused_schedule(stages: int, micro: int, forward: float = 1.0, backward: float = 2.0) -> list[list[Op]]:
    """Each rank's order of both models' operations, interleaved (``simulate`` with ``choose``)."""
    order, _, _ = simulate(sequential_schedule(stages, micro), forward, backward, choose=True)
    return order


def schedule_for(kind: str, stages: int, micro: int) -> list[list[Op]]:
    if kind == "sequential":
        return sequential_schedule(stages, micro)
    if kind == "fused":
        return fused_schedule(stages, micro)
    raise ValueError(f"unknown pipeline schedule {kind!r} (sequential or fused)")


# -- stages of a model ------------------------------------------------------------------------

class Stage(torch.nn.Module):
    """Some consecutive layers of a decoder, with its embedding (first stage) and its final
    norm and head (last stage: the LM head, or the critic's value head)."""

    def __init__(self, kind: str, base: torch.nn.Module, head: Optional[torch.nn.Module], layers: range,
                 first: bool, last: bool):
        super().__init__()
        self.kind, self.layer_ids, self.first, self.last = kind, list(layers), first, last
        self.base, self.head = base, head

    def forward(self, x: Optional[torch.Tensor], ids: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        if self.first:
            out = self.base(input_ids=ids, attention_mask=att, use_cache=False).last_hidden_state
        else:
            out = self.base(inputs_embeds=x, attention_mask=att, use_cache=False).last_hidden_state
        if not self.last:
            return out
        if self.kind == "actor":
            return self.head(out)
        return self.head(out).squeeze(-1)

    def full_name(self, name: str) -> str:
        """A parameter's (or state-dict entry's) name in the unsplit model
        (``AutoModelForCausalLM`` for the actor, ``ValueModel`` for the critic)."""
        prefix = "model." if self.kind == "actor" else "trunk."
        if name.startswith("base.layers."):
            index, rest = name[len("base.layers."):].split(".", 1)
            return f"{prefix}layers.{self.layer_ids[int(index)]}.{rest}"
        if name.startswith("base."):
            return prefix + name[len("base."):]
        return ("lm_head." if self.kind == "actor" else "value_head.") + name[len("head."):]

    def owned_state(self) -> dict[str, torch.Tensor]:
        """This stage's share of the unsplit model's state dict, by full name: its layers, the
        embedding on the first stage, the norm and head on the last (a later stage's copy of
        the embedding is unused, or, tied to the LM head, leaves as ``lm_head``)."""
        return {self.full_name(name): tensor.detach().clone() for name, tensor in self.state_dict().items()
                if self.first or not name.startswith("base.embed_tokens.")}


def load_model(model_path: str, kind: str, head_seed: Optional[int] = None) -> torch.nn.Module:
    """The unsplit model: the actor (causal LM) or the critic (``ValueModel``; ``head_seed``:
    a small random value head instead of zeros, so its trunk has gradients at once)."""
    from transformers import AutoModel, AutoModelForCausalLM

    check_model_folder(model_path)
    if kind == "actor":
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    from workers.train.critic import ValueModel

    model = ValueModel(AutoModel.from_pretrained(model_path, dtype=torch.float32)).eval()
    if head_seed is not None:
        gen = torch.Generator().manual_seed(head_seed)
        with torch.no_grad():
            model.value_head.weight.copy_(torch.randn(model.value_head.weight.shape, generator=gen) * 0.1)
    return model


def build_stage(model_path: str, kind: str, stage: int, stages: int, head_seed: Optional[int] = None) -> Stage:
    full = load_model(model_path, kind, head_seed)
    base = full.model if kind == "actor" else full.trunk
    for needed in ("embed_tokens", "layers", "norm"):
        if not hasattr(base, needed):
            raise ValueError(f"{type(base).__name__} has no {needed}: pipeline stages split Llama/Qwen2/Mistral-"
                             f"style decoders only")
    layers = split_layers(len(base.layers), stages)[stage]
    base.layers = torch.nn.ModuleList([base.layers[i] for i in layers])
    config = copy.deepcopy(base.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
        if hasattr(base, "has_sliding_layers"):
            base.has_sliding_layers = "sliding_attention" in config.layer_types
    base.config = config
    first, last = stage == 0, stage == stages - 1
    if not last:
        base.norm = torch.nn.Identity()
    head = (full.lm_head if kind == "actor" else full.value_head) if last else None
    return Stage(kind, base, head, layers, first, last)


# -- one step on the ranks ----------------------------------------------------------------

@dataclass(frozen=True)
class Hyper:
    """What the losses take: the trainer's settings for one optimiser step."""
    denominator: float  # the step's token count (token-mean loss)
    clip: float = 0.2
    behav_weight_cap: float = 5.0
    value_clip: float = 0.2
    temperature: float = 1.0
    head_seed: Optional[int] = None
    loss: str = "ppo"  # or "reinforce" (algorithm.loss)
    top_k: int = -1  # the rollout's truncation, as the trainer's log-probs apply it
    top_p: float = 1.0
    kl_coef: float = 0.0  # > 0: the micro-batches carry log π_ref ("ref", from the inference stage)
    kl_estimator: str = "k2"
    correction: str = "none"  # algorithm.correction, correction_level, correction_cap
    correction_level: str = "token"
    correction_cap: float = 2.0

    @classmethod
    def of(cls, spec, denominator: float) -> "Hyper":
        algo = spec.algorithm
        return cls(denominator=denominator, clip=algo.clip, behav_weight_cap=algo.behav_weight_cap,
                   value_clip=spec.critic.value_clip, temperature=max(spec.rollout.temperature, 1e-5),
                   loss=algo.loss, top_k=spec.rollout.top_k, top_p=spec.rollout.top_p,
                   # kl_penalty 'reward': GAE's rewards carry the KL (samples.with_critic_targets), the loss not
                   kl_coef=algo.kl_coef if algo.kl_penalty == "loss" else 0.0,
                   kl_estimator=algo.kl_estimator, correction=algo.correction,
                   correction_level=algo.correction_level, correction_cap=algo.correction_cap)


def micro_batches(samples: list, rows: int = 0, pad_id: int = 0, parts: Optional[list[list[int]]] = None) -> list[dict]:
    """GAE-trained samples (``TrainSample`` with ``token_advantages``, ``values`` and
    ``returns``: after ``Trainer.critic_targets``) as micro-batches, each the tensors both
    models' losses take, in the trainer's layout: ``rows`` sequences each, or the index
    lists ``parts``. ``ref`` (log π_ref) where the samples bring it."""
    from workers.train.batching import completion_mask, pad_sequences, per_token

    if parts is None:
        parts = [list(range(start, min(start + rows, len(samples)))) for start in range(0, len(samples), rows)]
    out = []
    for indices in parts:
        part = [samples[i] for i in indices]
        pairs = [(s.prompt_ids, s.token_ids) for s in part]
        ids, att = pad_sequences(pairs, pad_id)
        columns = ids.shape[1] - 1
        # an episode's observation tokens are masked out of both losses and their statistics
        mb = {"ids": ids, "att": att, "mask": completion_mask(pairs, columns,
                                                              [getattr(s, "loss_mask", None) for s in part]),
              "behav": per_token(pairs, columns, [s.behav_logprobs for s in part]),
              "adv": per_token(pairs, columns, [s.token_advantages for s in part]),
              "old_values": per_token(pairs, columns, [s.values for s in part]),
              "returns": per_token(pairs, columns, [s.returns for s in part])}
        if all(getattr(s, "ref_logprobs", None) is not None for s in part):
            mb["ref"] = per_token(pairs, columns, [s.ref_logprobs for s in part])
        out.append(mb)
    return out


def _loss(kind: str, out: torch.Tensor, mb: dict, hyper: Hyper, stats: Optional[dict] = None) -> torch.Tensor:
    """The trainer's objective for one model on one micro-batch (workers/train/trainer.py
    ``accumulate``); adds its statistics to ``stats``."""
    from workers.train import algorithms

    ids, mask = mb["ids"], mb["mask"]
    stats = {} if stats is None else stats
    if kind == "actor":
        logits = out[:, :-1].float() / max(hyper.temperature, 1e-5)
        logp, entropy = algorithms.token_logprobs(logits, ids[:, 1:], top_k=hyper.top_k, top_p=hyper.top_p,
                                                  with_entropy=True)
        correction = algorithms.Correction(hyper.correction, hyper.correction_level, hyper.correction_cap)
        if hyper.loss == "ppo":
            # one optimiser step per batch: π_prox is the policy being differentiated (as the trainer)
            result = algorithms.ppo_decoupled_loss(logp, logp.detach(), mb["behav"], mb["adv"], mask, hyper.clip,
                                                   hyper.behav_weight_cap, hyper.denominator, correction)
        else:
            result = algorithms.reinforce_tis_loss(logp, mb["behav"], mb["adv"], mask, hyper.behav_weight_cap,
                                                   hyper.denominator, correction)
        loss = result.loss
        if hyper.kl_coef > 0:
            if "ref" not in mb:
                raise RuntimeError("algorithm.kl_coef > 0 in a pipeline: the samples bring no reference log-probs "
                                   "(algorithm.kl_reference 'stage')")
            kl = algorithms.kl_penalty(logp, mb["ref"], mask, hyper.denominator, hyper.kl_estimator,
                                       weights=result.weights)
            loss = loss + hyper.kl_coef * kl
            stats["kl"] = stats.get("kl", 0.0) + float(kl.detach())
        for key, value in (("loss", float(result.loss.detach())), ("clip", result.clip_frac * result.tokens),
                           ("entropy", float((entropy.detach() * mask).sum())), ("tokens", result.tokens),
                           ("dropped", result.dropped), ("padded", ids.numel()), ("micro", 1)):
            stats[key] = stats.get(key, 0) + value
        return loss
    loss, clip_frac = algorithms.value_loss(out[:, :-1].float(), mb["old_values"], mb["returns"], mask,
                                            hyper.value_clip, hyper.denominator)
    stats["value_loss"] = stats.get("value_loss", 0.0) + float(loss.detach())
    stats["value_clip"] = stats.get("value_clip", 0.0) + clip_frac * float(mask.sum())
    return loss


def reference_gradients(model_path: str, micro_batches: list[dict], hyper: Hyper) -> dict[str, dict]:
    """The unsplit models' gradients for the same losses, in one process: what every
    schedule must reproduce."""
    out = {}
    for kind in MODELS:
        model = load_model(model_path, kind, hyper.head_seed)
        for mb in micro_batches:
            if kind == "actor":
                result = model(input_ids=mb["ids"], attention_mask=mb["att"]).logits
            else:
                result = model(mb["ids"], mb["att"])
            _loss(kind, result, mb, hyper).backward()
        out[kind] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out


def _tag(op: Op, micro: int, grad: bool) -> int:
    return ((MODELS.index(op.model) * 2 + int(grad)) * micro + op.micro)


def run_ops(ops: list[Op], models: dict, mbs: list[dict], rank: int, stages: int, hidden: int, hyper: Hyper,
            stats: Optional[dict] = None) -> float:
    """One rank's operations of a step, in order: forwards and backwards, receiving what each
    waits for (blocking) and sending what the next stage needs (not blocking); each model's
    loss statistics go to ``stats[model]``. Returns the seconds spent computing."""
    import torch.distributed as dist

    micro = len(mbs)
    stats = {m: {} for m in MODELS} if stats is None else stats
    kept: dict[tuple, tuple] = {}
    sends = []
    compute = 0.0
    for op in ops:
        module, stage = models[op.model], stage_of(op.model, rank, stages)
        mb = mbs[op.micro]
        shape = (mb["ids"].shape[0], mb["ids"].shape[1], hidden)
        if op.kind == "F":
            x = None
            if stage > 0:
                x = torch.empty(shape)
                dist.recv(x, src=stage_of(op.model, stage - 1, stages), tag=_tag(op, micro, False))
                x.requires_grad_(True)
            t0 = time.perf_counter()
            out = module(x, mb["ids"], mb["att"])
            result = _loss(op.model, out, mb, hyper, stats[op.model]) if module.last else out
            compute += time.perf_counter() - t0
            if not module.last:
                sends.append((dist.isend(out.detach().contiguous(), dst=stage_of(op.model, stage + 1, stages),
                                         tag=_tag(op, micro, False)), out))
            kept[(op.model, op.micro)] = (x, result)
        else:
            x, result = kept.pop((op.model, op.micro))
            grad = None
            if not module.last:
                grad = torch.empty(shape)
                dist.recv(grad, src=stage_of(op.model, stage + 1, stages), tag=_tag(op, micro, True))
            t0 = time.perf_counter()
            if grad is None:
                result.backward()
            else:
                result.backward(grad)
            compute += time.perf_counter() - t0
            if x is not None:
                sends.append((dist.isend(x.grad.contiguous(), dst=stage_of(op.model, stage - 1, stages),
                                         tag=_tag(op, micro, True)), x.grad))
    for work, _ in sends:
        work.wait()
    return compute


def holds_tied_embedding(actor: Stage, rank: int, stages: int) -> bool:
    """Whether this rank holds one of the two copies of an actor embedding that is also its LM
    head: the first stage's (as the embedding) and the last's (as the head)."""
    tied = bool(getattr(actor.base.config, "tie_word_embeddings", False))
    return tied and stages > 1 and rank in (0, stages - 1)


def bubble_share(wall: float, compute: list[float]) -> float:
    """The ranks' mean idle share of a step of ``wall`` seconds (waiting for another rank)."""
    return sum(1 - c / wall for c in compute) / len(compute) if wall > 0 else 0.0
