"""The trainer of a GAE run as RLHFuse's fused pipeline (``trainer.pipeline.stages`` ≥ 2): a
drop-in for ``Trainer`` in the controller.

Each step: the critic's values for the samples that do not bring them (a no-grad forward
through the critic's pipeline stages), GAE's targets from them, then both models' forwards
and backwards over ``trainer.pipeline.micro_batches`` micro-batches in the fused schedule
(or ``sequential``: the two pipelines one after the other), and each model's optimiser
step (workers/train/pipeline_group.py). The actor's objective is the trainer's (decoupled
PPO or REINFORCE-TIS, the rollout's truncation, KL to the inference stage's reference).

What it is not: DeepSpeed. The stages train fp32 with plain AdamW and global-norm clipping,
on the CPU (gloo); ZeRO, mixed precision, several minibatches per batch, stream training
and GPU placement are refused by the spec and the placement.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Optional

import torch

from workers.spec import RunSpec
from workers.tasks.model_folder import check_model_folder
from workers.train import algorithms
from workers.train.batching import generated_columns, pad_sequences
from workers.train.pipeline import Hyper, bubble_share, micro_batches
from workers.train.pipeline_group import Optim, PipelineGroup
from workers.train.samples import (TrainSample, critic_sums_of, step_denominator, whiten_targets,
                                   with_critic_targets)

if TYPE_CHECKING:
    from workers.weights.files import WeightFile

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "added_tokens", "spiece",
                    "sentencepiece")


def length_sorted_parts(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices cut into at most ``parts`` micro-batches of consecutive lengths (sorted, so a
    micro-batch pads little), as even in rows as can be."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    parts = max(1, min(parts, len(order)))
    base, extra = divmod(len(order), parts)
    out, start = [], 0
    for p in range(parts):
        n = base + (1 if p < extra else 0)
        out.append(order[start:start + n])
        start += n
    return [p for p in out if p]


class PipelineTrainer:
    def __init__(self, spec: RunSpec, model_path: str, threads: Optional[int] = None, pad_id: int = 0):
        self.spec, self.model_path, self.pad_id = spec, model_path, pad_id
        pipeline = spec.trainer.pipeline
        self.stages, self.schedule, self.micro = pipeline.stages, pipeline.schedule, pipeline.micro_batches
        from transformers import AutoConfig

        # the config class's default where the file leaves it out (a GPT-2 ties, a Llama does not)
        self.tied = bool(getattr(AutoConfig.from_pretrained(check_model_folder(model_path)), "tie_word_embeddings",
                                 False))
        self.group = PipelineGroup(model_path, self.stages, Optim.of(spec),
                                   threads=max(1, (threads or 1) // self.stages))
        self.version = 0
        log.info("trainer: actor and critic as a %s pipeline of %d stages, %d micro-batches a step%s",
                 self.schedule, self.stages, self.micro, " (tied embedding shared by the end stages)" if self.tied else "")

    @property
    def pids(self) -> list[int]:
        return self.group.pids

    # -- training ---------------------------------------------------------------------------
    def critic_targets(self, batch: list[TrainSample]) -> tuple[list[TrainSample], dict[str, float]]:
        """GAE's targets for every sample, valuing (through the critic's stages) those that do
        not bring their values (critic.forward: stage brings them)."""
        algo, out = self.spec.algorithm, list(batch)
        need = [i for i, s in enumerate(batch) if s.values is None]
        lengths = [len(batch[i].prompt_ids) + len(batch[i].token_ids) for i in need]
        parts = [[need[k] for k in part] for part in length_sorted_parts(lengths, self.micro)] if need else []
        tensors = [pad_sequences([(batch[i].prompt_ids, batch[i].token_ids) for i in part], self.pad_id)
                   for part in parts]
        valued = self.group.values(tensors) if tensors else []
        for part, values in zip(parts, valued):
            for row, i in enumerate(part):
                s = batch[i]
                out[i] = with_critic_targets(s, values[row, generated_columns(len(s.prompt_ids),
                                                                              len(s.token_ids))].tolist(), algo)
        for i, s in enumerate(batch):
            if s.values is not None:
                out[i] = with_critic_targets(s, list(s.values), algo)
        sums = critic_sums_of(out, algo)  # over trained tokens (an episode's observations left out)
        return whiten_targets(out, sums, algo), sums  # whitened over the whole batch (one process)

    def train_step(self, batch: list[TrainSample]) -> dict[str, float]:
        """One optimiser step of the actor and the critic on the whole batch."""
        start = time.perf_counter()
        batch, sums = self.critic_targets(batch)
        denominator = step_denominator(batch, self.spec.algorithm.normalize)
        parts = length_sorted_parts([len(s.prompt_ids) + len(s.token_ids) for s in batch], self.micro)
        ranks = self.group.train(micro_batches(batch, pad_id=self.pad_id, parts=parts),
                                 Hyper.of(self.spec, denominator), self.schedule)
        self.version += 1
        actor = _summed(r.stats.get("actor", {}) for r in ranks)
        critic = _summed(r.stats.get("critic", {}) for r in ranks)
        wall = max(r.wall_s for r in ranks)
        tokens = max(actor.get("tokens", 0), 1)
        seconds = time.perf_counter() - start
        return {
            **algorithms.critic_stats(sums),
            "critic/value_loss": critic.get("value_loss", 0.0),
            "critic/value_clip_frac": critic.get("value_clip", 0.0) / tokens,
            "critic/grad_norm": ranks[0].grad_norm.get("critic", 0.0),
            "loss/policy": actor.get("loss", 0.0),
            "loss/kl": actor.get("kl", 0.0),
            "policy/clip_frac": actor.get("clip", 0.0) / tokens,
            "policy/behav_dropped_frac": actor.get("dropped", 0) / tokens,
            "policy/entropy": actor.get("entropy", 0.0) / tokens,
            "policy/grad_norm": ranks[0].grad_norm.get("actor", 0.0),
            "trainer/tokens_per_s": actor.get("padded", 0) / seconds,
            "trainer/micro_batches": actor.get("micro", 0),
            "trainer/step_s": seconds,
            "pipeline/step_s": wall,
            "pipeline/bubble": bubble_share(wall, [r.compute_s for r in ranks]),
        }

    # -- weights and checkpoints ------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The actor's full tensors by the unsplit model's names (its stages' shares)."""
        return self.group.state_dict("actor")

    def critic_state_dict(self) -> dict[str, torch.Tensor]:
        return self.group.state_dict("critic")

    def write_weight_file(self, path: str) -> "WeightFile":
        """The actor's weights as a safetensors file at ``path`` (files.WeightWriter)."""
        from workers.weights.files import write_weight_file

        return write_weight_file(self.state_dict(), path)

    def save(self, path: str) -> None:
        """A Hugging Face folder vLLM and transformers load: the actor's weights (a tied LM
        head left to the embedding, as save_pretrained writes it), the model's config,
        generation config and tokenizer files."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        state = self.state_dict()
        if self.tied:
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})
        for name in os.listdir(self.model_path):
            if name in ("config.json", "generation_config.json") or name.startswith(_TOKENIZER_FILES):
                shutil.copy(os.path.join(self.model_path, name), path)

    def save_state(self, folder: str) -> None:
        self.group.save_state(folder)
        with open(os.path.join(folder, "pipeline-trainer.json"), "w", encoding="utf-8") as fh:
            json.dump({"fluxrl_version": self.version}, fh)

    def load_state(self, folder: str) -> int:
        self.group.load_state(folder)
        with open(os.path.join(folder, "pipeline-trainer.json"), encoding="utf-8") as fh:
            self.version = int(json.load(fh)["fluxrl_version"])
        return self.version

    def missing_state_files(self, folder: str) -> list[str]:
        """Which of ``save_state``'s files ``folder`` lacks."""
        names = ["pipeline.json", "pipeline-trainer.json"] + [f"pipeline-rank{r}.pt" for r in range(self.stages)]
        return [name for name in names if not os.path.isfile(os.path.join(folder, name))]

    def close(self) -> None:
        self.group.close()


def _summed(parts) -> dict:
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0) + value
    return out
