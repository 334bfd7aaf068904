"""The trainer's side of a step, as the schedules and the Controller call it: trainer work
run in a thread and timed, the samples a group trains as, the token-exactness check of an
episode batch, and the critic stage's reload."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from workers.agents.episode import engine_ids, loss_mask
from workers.coord.generation import Group
from workers.coord.processes import Processes
from workers.coord.time_breakdown import TimeBreakdown
from workers.spec import RunSpec
from workers.train import algorithms
from workers.train.batching import token_exact
from workers.train.samples import TrainSample

logger = logging.getLogger(__name__)


class TrainerError(RuntimeError):
    """The trainer raised: the run fails (exit code 1, status failed) with this as its reason."""


def train_samples(spec: RunSpec, group: Group) -> list[TrainSample]:
    """Group-relative advantages need only the group itself, so a group can be
    trained on the moment it is complete. With GAE the trainer's critic computes them
    from each sample's reward."""
    rewards = [s.reward for s in group.samples]
    if spec.algorithm.advantage == "gae":
        adv = [0.0] * len(rewards)
    else:
        adv = algorithms.group_advantages(rewards, spec.algorithm.group_size, spec.algorithm.adv_std_norm)
    return [TrainSample(s.completion.prompt_ids, s.completion.token_ids, s.completion.logprobs, a, reward=r,
                        ref_logprobs=s.ref_logprobs, values=s.values, versions=s.completion.versions.per_token(),
                        loss_mask=loss_mask(s.completion), token_rewards=s.token_rewards)
            for s, a, r in zip(group.samples, adv, rewards)]


class TrainerWork:
    """Work on the run's trainer (``processes.trainer``, once started), timed into
    ``times`` (time/train_s) and ``busy_s`` (idle/training)."""

    def __init__(self, spec: RunSpec, processes: Processes, times: TimeBreakdown):
        self.spec = spec
        self.processes = processes
        self.times = times
        self.busy_s = 0.0

    @property
    def trainer(self):
        return self.processes.trainer

    async def run(self, fn, *args):
        """Run trainer work in a thread (generation streams on meanwhile), timing it."""
        t0 = time.perf_counter()
        self.times.begin("train")
        try:
            return await asyncio.to_thread(fn, *args)
        except Exception as exc:  # not a bad-input exit (2) even if it is a ValueError
            raise TrainerError(f"the trainer failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self.times.end("train")
            self.busy_s += time.perf_counter() - t0

    def samples(self, group: Group) -> list[TrainSample]:
        return train_samples(self.spec, group)

    def token_exactness(self, groups: list[Group]) -> dict[str, float]:
        """task.environment: agent/token_exact, the share of the step's samples whose ids at
        the trained positions, packed as the trainer packs them (batching.py), equal the ids
        the engine returned turn by turn. Anything below 1.0 is a bug, logged loudly."""
        if self.spec.task.environment is None:
            return {}
        samples = [s for g in groups for s in g.samples]
        exact = token_exact([(s.completion.prompt_ids, s.completion.token_ids) for s in samples],
                            [loss_mask(s.completion) for s in samples], [engine_ids(s.completion) for s in samples],
                            getattr(self.trainer, "pad_id", 0))
        if not all(exact):
            logger.error("token-exactness: %d of %d trained samples' ids differ from the engine's",
                         exact.count(False), len(exact))
        return {"agent/token_exact": sum(exact) / max(1, len(exact))}

    async def load_critic_stage(self) -> Optional[float]:
        """critic.forward stage: the trainer critic's weights into the stage's copy; the seconds it took."""
        stage = self.processes.critic_stage
        if stage is None:
            return None
        t0 = time.perf_counter()
        state = await self.run(self.trainer.critic_state_dict)
        await asyncio.to_thread(stage.load, state, self.trainer.version)
        return time.perf_counter() - t0
