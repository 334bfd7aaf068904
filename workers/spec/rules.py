"""The rules that tie fields of a run spec together, as one table (RULES): what a spec may not
ask for in combination, each rule stated once, with the message naming what it needs.

RunSpec checks the table once every section has validated and the defaults that depend
on other sections are filled in (run.py). The groups are checked in the table's order and
the first one with a broken rule refuses the spec."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

# A RunSpec. run.py imports this module, so the predicates read the spec without its type.
Spec = Any


@dataclass(frozen=True)
class Rule:
    """One refusal. ``broken(spec)`` is true when the spec asks for something it cannot
    have. ``needs`` says what it needs, as text or (where it quotes the spec's values) a
    function of the spec."""
    broken: Callable[[Spec], bool]
    needs: Union[str, Callable[[Spec], str]]

    def message(self, spec: Spec) -> str:
        return self.needs(spec) if callable(self.needs) else self.needs


@dataclass(frozen=True)
class RuleGroup:
    """The rules for what one field asks (``asks``), checked when ``applies(spec)``.

    With a ``lead``, the refusal is the lead followed by the needs of every broken rule,
    joined by '; ' ("model.lora needs A; B"): one message names all that the field is
    missing. Without a lead, each rule's ``needs`` is a whole message and the first broken
    rule refuses."""
    asks: str
    applies: Callable[[Spec], bool]
    rules: tuple[Rule, ...]
    lead: Optional[str] = None

    def refusal(self, spec: Spec) -> Optional[str]:
        if not self.applies(spec):
            return None
        broken = [rule.message(spec) for rule in self.rules if rule.broken(spec)]
        if not broken:
            return None
        return self.lead + "; ".join(broken) if self.lead else broken[0]


def _whiten_over_the_batch(s: Spec) -> bool:
    """A streamed GAE step whitens over the whole batch only at its end, from gradients
    accumulated apart in p.grad (workers/train/trainer.py, "whiten_advantages in a streamed
    GAE step")."""
    return s.algorithm.advantage == "gae" and s.algorithm.whiten_advantages


def _set_without_a_split(s: Spec) -> str:
    i, one = next((i, one) for i, one in enumerate(s.eval.sets) if one.dataset is None)
    return (f"eval.sets.{i} ({one.name}) has no dataset, so it evaluates the run's held-out split, but "
            "task.eval_size is 0: give the set a dataset, or hold rows out")


RULES: tuple[RuleGroup, ...] = (
    RuleGroup("rollout.gather_tail", lambda s: bool(s.rollout.gather_tail), (
        Rule(lambda s: bool(s.rollout.migrate_tail),
             "rollout.gather_tail and rollout.migrate_tail pull a step's tail opposite ways (onto the fewest "
             "engines, or spread to the idlest): choose one"),
    )),
    RuleGroup("schedule.stream_train", lambda s: s.schedule.stream_train, (
        Rule(lambda s: s.schedule.mode != "sync",
             "schedule.stream_train applies to schedule.mode 'sync' (async mode streams already)"),
        Rule(lambda s: s.algorithm.minibatches > 1 or s.algorithm.ppo_epochs > 1,
             "schedule.stream_train trains each batch in one optimiser step: algorithm.minibatches and ppo_epochs "
             "must be 1"),
        Rule(lambda s: _whiten_over_the_batch(s) and (s.trainer.zero_stage != 0 or s.model.dtype == "float16"),
             "schedule.stream_train with algorithm.advantage 'gae' and whiten_advantages needs trainer.zero_stage 0 "
             "and a model.dtype other than float16: the advantages are whitened over the whole batch at the step's "
             "end, from gradients kept apart in p.grad, which ZeRO 1-3 partition and fp16 loss-scales (or set "
             "algorithm.whiten_advantages false)"),
    )),
    RuleGroup("algorithm.drop_uniform_groups", lambda s: s.algorithm.drop_uniform_groups, (
        Rule(lambda s: s.schedule.mode != "async",
             "algorithm.drop_uniform_groups needs schedule.mode 'async' (a synchronous step trains on the batch it "
             "generated; there is nothing to fill the gap with)"),
        Rule(lambda s: s.algorithm.group_size < 2,
             "algorithm.drop_uniform_groups needs algorithm.group_size >= 2 (a group of one is always uniform)"),
    )),
    # what the pipeline trainer does not do (workers/train/pipeline_trainer.py)
    RuleGroup("trainer.pipeline.stages", lambda s: s.trainer.pipeline.stages > 1,
              lead="trainer.pipeline.stages > 1 needs ", rules=(
        Rule(lambda s: s.algorithm.advantage != "gae",
             "algorithm.advantage 'gae' (it fuses the actor's and the critic's training; without a critic use the "
             "DeepSpeed trainer)"),
        Rule(lambda s: s.trainer.zero_stage != 0 or s.critic.zero_stage != 0,
             "trainer.zero_stage and critic.zero_stage 0 (its stages are not DeepSpeed engines)"),
        Rule(lambda s: s.model.dtype not in ("auto", "float32"),
             "model.dtype float32 (its stages train in fp32 on the CPU)"),
        Rule(lambda s: s.algorithm.minibatches > 1 or s.algorithm.ppo_epochs > 1,
             "algorithm.minibatches and ppo_epochs 1 (one optimiser step per batch)"),
        Rule(lambda s: s.schedule.stream_train, "schedule.stream_train off"),
        Rule(lambda s: s.algorithm.kl_coef > 0 and s.algorithm.kl_reference != "stage",
             "algorithm.kl_reference 'stage' with kl_coef > 0 (the reference is not split into stages; the "
             "inference stage brings its log-probs)"),
        Rule(lambda s: s.resources.trainer_ranks > 1 or s.resources.nodes > 1,
             "resources.trainer_ranks 1 and nodes 1 (its ranks are the stages)"),
    )),
    # what a LoRA run does not do (yet)
    RuleGroup("model.lora", lambda s: s.model.lora is not None,
              lead="model.lora needs ", rules=(
        Rule(lambda s: s.trainer.pipeline.stages > 1,
             "trainer.pipeline.stages 1 (the pipeline trainer's stages train the full model)"),
        Rule(lambda s: s.trainer.zero_stage == 3,
             "trainer.zero_stage 0, 1 or 2 (ZeRO-3 would shard a frozen base model that every rank needs whole for "
             "its forward: nothing to gain, not supported)"),
        Rule(lambda s: s.algorithm.advantage == "gae",
             "algorithm.advantage 'group' (a critic is a full second model; LoRA with a critic is not supported "
             "yet)"),
        Rule(lambda s: s.rollout.weight_transport == "collective",
             "rollout.weight_transport 'rpc' (the adapter is a file of a few MB that vLLM loads as a LoRA; the "
             "collective path writes full weights)"),
        Rule(lambda s: s.resources.colocate, "resources.colocate false (not supported with LoRA yet)"),
    )),
    # what a run on shared engine pools needs (docs/guides/shared-engines.md)
    RuleGroup("rollout.share_engines", lambda s: s.rollout.share_engines,
              lead="rollout.share_engines needs ", rules=(
        Rule(lambda s: s.model.lora is None,
             "model.lora (runs share the base model; each brings its adapter)"),
        Rule(lambda s: s.rollout.update_mode == "drain",
             "rollout.update_mode 'keep' or 'interrupt' (a drain would wait for the other runs' requests too)"),
        Rule(lambda s: s.resources.nodes > 1, "resources.nodes 1 (pools serve the runs of their own node)"),
        Rule(lambda s: s.resources.engine_processes is False,
             "resources.engine_processes left on (a pool is a process of its own)"),
        Rule(lambda s: s.schedule.dispatch == "skew_aware",
             "schedule.dispatch other than 'skew_aware' (its priorities order one run's requests; on a shared "
             "engine vLLM would compare them with other runs' and preempt theirs)"),
        Rule(lambda s: s.algorithm.group_size > s.rollout.max_num_seqs,
             lambda s: f"algorithm.group_size at most rollout.max_num_seqs ({s.algorithm.group_size} > "
             f"{s.rollout.max_num_seqs}: the pool's engine has that many seats, shared with the other runs)"),
    )),
    RuleGroup("algorithm.advantage", lambda s: s.algorithm.advantage == "gae", (
        Rule(lambda s: s.resources.nodes > 1,
             "algorithm.advantage 'gae' runs on one node for now (resources.nodes 1): its critic trains beside "
             "each trainer rank there, but has not been tried across nodes"),
    )),
    RuleGroup("critic.forward", lambda s: s.critic.forward == "stage", (
        Rule(lambda s: s.algorithm.advantage != "gae",
             "critic.forward 'stage' runs the critic's forward, which only algorithm.advantage 'gae' has: set "
             "advantage gae, or leave critic.forward out"),
    )),
    RuleGroup("algorithm.kl_reference", lambda s: s.algorithm.kl_reference == "stage", (
        Rule(lambda s: s.algorithm.kl_coef == 0,
             "algorithm.kl_reference 'stage' runs the KL reference's forward, which only algorithm.kl_coef > 0 "
             "uses: set kl_coef, or leave kl_reference out"),
    )),
    # a set without a dataset evaluates the run's held-out split
    RuleGroup("eval.sets", lambda s: any(one.dataset is None for one in s.eval.sets), (
        Rule(lambda s: s.task.eval_size == 0, _set_without_a_split),
    )),
)


def refusal(spec: Spec) -> Optional[str]:
    """The message of the first group in RULES that ``spec`` breaks, or None."""
    return next((message for group in RULES if (message := group.refusal(spec)) is not None), None)
