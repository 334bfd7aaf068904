"""What a run reports: the metrics of each trained step (metrics.jsonl through the
Reporter, a few samples for the run page), how busy generation and training were, and
the run's totals (``RunResult``, result.json)."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from workers.agents.episode import agent_metrics, episode_view

if TYPE_CHECKING:
    from workers.coord.generation import Fleet
    from workers.coord.length_ranker import LengthRanker
    from workers.coord.trainer_work import TrainerWork
    from workers.io.report import Reporter
    from workers.spec import RunSpec


@dataclass
class RunResult:
    steps: int = 0
    trained_samples: int = 0
    trained_tokens: int = 0
    seconds: float = 0.0
    accuracy_before: Optional[float] = None
    accuracy_after: Optional[float] = None
    sampled_reward_before: Optional[float] = None  # eval.samples > 0: expected held-out reward
    sampled_reward_after: Optional[float] = None
    staleness_max: int = 0
    dropped_stale: int = 0
    dropped_uniform: int = 0  # algorithm.drop_uniform_groups: groups whose rewards were all equal
    trained_groups: int = 0
    update_sync_ms: list[float] = field(default_factory=list)
    update_load_ms: list[float] = field(default_factory=list)
    gen_stall_ms: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    final_model: Optional[str] = None
    skipped_prompts: int = 0  # training + held-out prompts longer than max_model_len allows
    idle_generation: float = 0.0  # share of wall time no request was running (mean over engines)
    idle_training: float = 0.0  # share of wall time the trainer was not computing
    memory_peak_gib: dict[str, float] = field(default_factory=dict)  # each process's peak resident memory
    memory_plan_gib: dict[str, float] = field(default_factory=dict)  # CPU plans: the planner's figure per process
    exporters: dict[str, str] = field(default_factory=dict)  # report.*: "ok" or the error that dropped one

    @property
    def samples_per_s(self) -> float:
        return self.trained_samples / self.seconds if self.seconds else 0.0


def peak_resident_gib(pid: int) -> Optional[float]:
    """A live process's peak resident memory (Linux ``VmHWM``), GiB; None where unreadable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except (OSError, ValueError):
        return None
    return None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(math.ceil(q * len(s))) - 1)]


def long_tail_share(started: list[float], finished: list[float], q: float = 0.9) -> float:
    """The share of a batch's generation (its first start to its last finish) spent after
    the first ⌈q·n⌉ of its samples had finished: the time the long tail alone took."""
    if not finished:
        return 0.0
    span = max(finished) - min(started)
    if span <= 0:
        return 0.0
    k = max(1, math.ceil(q * len(finished)))
    return (max(finished) - sorted(finished)[k - 1]) / span


def inference_overlap(generated: list[float], began: list[float], scored: list[float]) -> Optional[float]:
    """The share of a batch's inference time (each sample's scoring and inference-stage
    forwards, from when they began to when they were done) that passed before the batch's
    last sample finished generating (``generated``: when each did): 0 when it all waits
    for a barrier, near 1 when it runs beside the generation's tail. None when inference
    took no measurable time."""
    if not generated:
        return None
    last = max(generated)
    total = sum(max(0.0, s - b) for b, s in zip(began, scored))
    if total <= 1e-6:
        return None
    return sum(max(0.0, min(s, last) - b) for b, s in zip(began, scored)) / total


class StepMetrics:
    """The per-step report and the busy/idle accounting of one run.

    Receives the run's ``spec``; its engines, prompt renderer and reward service
    (``fleet``); its totals (``result``); the ``reporter`` the metrics go to; the length
    ``ranker``; and ``work``, the trainer (``work.trainer``) and its busy time
    (``work.busy_s``)."""

    def __init__(self, spec: RunSpec, fleet: Fleet, result: RunResult, reporter: Reporter, ranker: LengthRanker,
                 work: TrainerWork):
        self.spec, self.fleet, self.result, self.reporter, self.ranker = spec, fleet, result, reporter, ranker
        self.work = work
        self.busy_before = 0.0  # engine busy time before the schedule started (the first evaluation)
        self._model_bytes: Optional[int] = None

    def model_bytes(self) -> Optional[int]:
        """weights/model_bytes: the run's model's parameters in model.dtype (its folder's
        tensors, a tied head once); read once, from the resolved model folder."""
        if self._model_bytes is None:
            from workers.spec import model_dtype
            from workers.weights.files import model_state_bytes

            spec = self.spec
            try:
                self._model_bytes = model_state_bytes(spec.model.path, model_dtype(spec))
            except (OSError, ValueError):  # a folder we cannot read here (another node's path): not reported
                self._model_bytes = 0
        return self._model_bytes or None

    def weight_bytes(self) -> dict:
        """weights/update_bytes (the last update's, sent to each engine) and weights/model_bytes."""
        out = {}
        if self.fleet.weights.update_bytes is not None:
            out["weights/update_bytes"] = self.fleet.weights.update_bytes
        if (full := self.model_bytes()) is not None:
            out["weights/model_bytes"] = full
        return out

    def gen_busy(self) -> float:
        """Seconds the engines (live and retired) have had requests running."""
        fleet = self.fleet
        now = time.perf_counter()
        return fleet.retired_busy + sum(e.busy_seconds(now) for e in fleet.engines)

    def idle_generation(self, elapsed: float) -> float:
        busy = self.gen_busy()
        return 1.0 - min(1.0, (busy - self.busy_before) / (elapsed * max(1, len(self.fleet.engines))))

    def idle_training(self, elapsed: float) -> float:
        return 1.0 - min(1.0, self.work.busy_s / elapsed)

    def collect_stalls(self) -> None:
        """Generation stalls of finished weight updates into the result and the metrics."""
        for e in self.fleet.engines:
            done = [u for u in e.updates if u.gen_stall_ms is not None or u.version < self.work.trainer.version - 1]
            for u in done:
                if u.gen_stall_ms is not None:
                    self.result.gen_stall_ms.append(u.gen_stall_ms)
                    self.reporter.log(u.version, {"weights/gen_stall_ms": u.gen_stall_ms})
                e.updates.remove(u)

    def pool_metrics(self) -> dict:
        """rollout.share_engines: this run's measured and due share of its pools' generation
        (the mean over its engines), and how many runs share them."""
        views = [v for e in self.fleet.engines if (v := getattr(e, "pool", None)) is not None]
        if not views:
            return {}
        return {"pool/share": sum(v.share for v in views) / len(views),
                "pool/fair_share": sum(v.fair_share for v in views) / len(views),
                "pool/runs": max(v.runs for v in views), "pool/teams": max(v.teams for v in views)}

    def report_step(self, step: int, groups: list, staleness: list[int], stats: dict, timings: list,
                    t_start: float, queue_depth: int) -> dict:
        """Add a trained step to the totals and report it (metrics and a few samples);
        returns the progress bar's postfix."""
        spec, fleet = self.spec, self.fleet
        prompts, rewards_service = fleet.prompts, fleet.rewards
        assert prompts is not None and rewards_service is not None  # set by Controller.setup
        rewards = [s.reward for g in groups for s in g.samples]
        samples = [s for g in groups for s in g.samples]
        r = self.result
        lengths = [s.completion.length for s in samples]
        r.steps, r.trained_samples = step, r.trained_samples + len(samples)
        r.trained_groups += len(groups)
        r.trained_tokens += sum(lengths)
        r.lengths += lengths
        r.staleness_max = max(r.staleness_max, max(staleness))
        r.update_sync_ms += [t.sync_ms for t in timings]
        r.update_load_ms += [t.load_ms for t in timings]
        elapsed = time.time() - t_start
        mean_r = sum(rewards) / len(rewards)
        hist = {f"staleness/hist/{k}": staleness.count(k) for k in range(max(staleness) + 1)}
        self.reporter.log(step, {
            **{k: v for k, v in stats.items() if not k.startswith("trainer/micro") and k != "trainer/step_s"},
            "reward/mean": mean_r,
            "reward/std": statistics.pstdev(rewards),
            "reward/errors": sum(1 for s in samples if s.error),
            **({"batch/dropped_uniform_share": r.dropped_uniform / (r.dropped_uniform + r.trained_groups)}
               if spec.algorithm.drop_uniform_groups else {}),
            **{f"reward/part/{name}": sum(s.parts.get(name, 0.0) for s in samples) / len(samples)
               for name in samples[0].parts},
            **{f"reward_model/{k}": v for k, v in rewards_service.model_stats().items()},
            **({f"reference_stage/{k}": v for k, v in fleet.reference.stats().items()} if fleet.reference else {}),
            **({f"critic_stage/{k}": v for k, v in fleet.critic.stats().items()} if fleet.critic else {}),
            "throughput/samples_per_s": r.trained_samples / elapsed,
            "throughput/tokens_per_s": r.trained_tokens / elapsed,
            "rollout/gen_tokens_per_s": (fleet.retired_tokens + sum(e.generated_tokens for e in fleet.engines)) / elapsed,
            "rollout/engines_live": len(fleet.engines),
            "rollout/engine_deaths": fleet.engine_deaths,
            "staleness/mean": sum(staleness) / len(staleness),
            "staleness/max": max(staleness),
            **hist,
            **({"weights/sync_ms": max(t.sync_ms for t in timings),
                "weights/load_ms": max(t.load_ms for t in timings)} if timings else {}),
            **self.weight_bytes(),
            **self.ranker.metrics(),
            **fleet.dispatch_metrics(),
            "generation/long_tail_share": long_tail_share([s.completion.started_at for s in samples],
                                                          [s.completion.finished_at for s in samples]),
            **({"inference/overlap": overlap} if (overlap := inference_overlap(
                [s.completion.finished_at for s in samples], [s.inference_started_at for s in samples],
                [s.scored_at for s in samples])) is not None else {}),
            "idle/generation": self.idle_generation(elapsed),
            "idle/training": self.idle_training(elapsed),
            "lengths/mean": sum(lengths) / len(lengths),
            "lengths/p99": percentile(lengths, 0.99),
            "queue/depth": queue_depth,
            "version/current": self.work.trainer.version,
            "rollout/migrations": fleet.tail.migrations,
            **self.pool_metrics(),
            **agent_metrics([s.completion for s in samples]),  # task.environment: agent/*
        })
        # A few samples for the run page; a sequence spanning an update first.
        shown = sorted(samples, key=lambda s: (-len(s.completion.versions.runs), -s.completion.length))[:4]
        for s in shown:
            record = {"step": step, "prompt": prompts.text(s.row), "completion": s.text,
                      "reward": s.reward, "versions": s.completion.versions.per_token(),
                      "tokens": prompts.pieces(s.completion.token_ids),
                      "length": s.completion.length, "error": s.error or ""}
            if s.completion.episode is not None:  # the turn-by-turn view (observation tokens masked)
                record["episode"] = episode_view(s.completion)
            self.reporter.sample(record)
        return {"reward": f"{mean_r:.2f}", "stale": max(staleness), "sps": f"{r.trained_samples / elapsed:.1f}"}


def memory_peaks(processes, engines: list) -> dict[str, float]:
    """Each process of the run on this node, by role, and its peak resident memory so far
    (GiB): ``processes`` (the run's Processes: trainer ranks, inference stage) and the
    live ``engines``."""
    import os

    pids = {"coordinator": os.getpid()}
    for rank, pid in enumerate(getattr(processes.trainer, "pids", None) or []):
        pids[f"trainer rank {rank}"] = pid
    for engine in engines:
        if getattr(engine, "server_pid", None):
            pids[f"engine {engine.index} server"] = engine.server_pid
        for k, pid in enumerate(engine.core_pids()):
            pids[f"engine {engine.index} vLLM core" + (f" {k}" if k else "")] = pid
    # the inference stage's workers (named as the plan names them)
    rewards = processes.rewards
    for name, worker in (("reward model", rewards.model if rewards else None),
                         ("KL reference stage", processes.reference), ("critic stage", processes.critic_stage)):
        proc = getattr(worker, "proc", None)
        if proc is not None and proc.poll() is None:
            pids[name] = proc.pid
    peaks = {name: peak_resident_gib(pid) for name, pid in pids.items()}
    return {name: round(gib, 2) for name, gib in peaks.items() if gib is not None}
