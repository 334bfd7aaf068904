"""Discrete-event simulator of RL training: where does the time go at cluster scale?

Model. Rollout engines do continuous batching: every running sequence gains one token
per decode step, a step takes ``a + b·batch`` seconds (memory-bound weights read plus
per-sequence KV/compute), at most ``max_seqs`` run at once, the rest wait; admitting a
request first costs its prefill. All completions of a prompt group go to one engine (as
in the controller) and a group enters training only once complete (GRPO advantages
need the whole group). The trainer costs ``train_per_token_s`` per prompt+completion
token plus ``train_step_s`` per optimiser step; a weight update costs the trainer
``sync_s`` and stalls engines ``load_s``.

Modes (all on disaggregated rollout/trainer GPUs; "sync colocated" is sync with both
phases given every GPU):
- ``sync``: generate the batch, barrier, train, update, repeat.
- ``stream`` (StreamRL): sync, but finished groups are trained in micro-batches while
  the tail of the batch is still generating.
- ``async`` (AReaL): admission keeps at most ``max_staleness`` versions of lead
  (``StalenessGate``'s rule); the trainer steps whenever a batch of groups is ready,
  oldest first; updates are ``keep``, ``interrupt`` or ``drain``; a group finishing
  too stale is trained on (default) or dropped (``Setup.stale_groups``).
- ``+skew`` (``stream+skew``, ``async+skew``): groups are dispatched with
  ``workers.coord.scheduling``'s ``longest_first`` on lengths predicted with correlation
  ``predictor_corr`` (log space) to the truth, instead of FIFO on count-balanced engines.

Throughput is trained samples/s between the end of step ``warmup_steps`` and the last.

At cluster scale (``cluster_costs``) the costs come from first-order scaling of a dense
model on H100-class hardware; ``recommend`` sweeps the rollout/trainer split with them.
"""
from __future__ import annotations

import functools
import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from workers.coord.scheduling import EngineLoads, dispatch_order, plan_dispatch

MODES = ("sync", "stream", "stream+skew", "async", "async+skew")


@dataclass(frozen=True)
class Costs:
    decode_step_s: float  # a: one decode step of an engine, whatever the batch
    decode_per_seq_s: float  # b: added per running sequence
    prefill_per_token_s: float
    train_per_token_s: float  # the whole trainer, per prompt+completion token
    train_step_s: float = 0.0  # per optimiser step (optimiser, fixed overheads)
    sync_s: float = 0.0  # trainer side of a weight update
    load_s: float = 0.0  # engine stall while loading new weights
    max_seqs: int = 256  # sequences an engine runs at once (KV-cache bound)


@dataclass(frozen=True)
class Workload:
    lengths: tuple[int, ...]  # pool of per-prompt completion lengths, sampled with replacement
    prompt_tokens: int = 16
    group_size: int = 8
    batch_prompts: int = 8
    within_group_sigma: float = 0.0  # lognormal spread of lengths inside a group
    micro_batch_tokens: int = 4096  # stream mode's training micro-batch


@dataclass(frozen=True)
class Setup:
    engines: int = 1
    mode: str = "async"  # sync | stream | async
    skew: bool = False
    predictor_corr: float = 0.8
    max_staleness: int = 2
    update_mode: str = "keep"  # async: keep | interrupt | drain
    # async, a finished group older than max_staleness versions: "drop" it and give its
    # admission slot back, "drop_keep_slot" (the controller today: every drop shrinks the
    # pipeline's lead for good) or "train" on it anyway (AReaL: the bound is on admission
    # only; decoupled PPO corrects the off-policy tokens).
    stale_groups: str = "train"
    steps: int = 10
    warmup_steps: int = 2  # excluded from the throughput and idle figures
    seed: int = 0


@dataclass
class SimResult:
    samples_per_s: float
    tokens_per_s: float
    gen_idle: float  # share of engine time not decoding or prefilling
    train_idle: float  # share of trainer time not training
    staleness_mean: float = 0.0
    dropped_groups: int = 0
    seconds: float = 0.0
    steps: int = 0


@dataclass
class _Group:
    index: int
    predicted: float  # what the length ranker would say for its prompt
    lengths: list[int]  # its completions'
    version: int = 0  # policy version when admitted
    left: int = 0  # completions still generating
    tokens: int = 0  # prompt + completion tokens finished


@dataclass
class _Request:
    group: _Group
    length: int
    start_progress: float = 0.0


@dataclass
class _Engine:
    progress: float = 0.0  # tokens each running sequence has gained since t=0
    running: list = field(default_factory=list)  # heap of (progress at which it finishes, id, request)
    waiting: deque = field(default_factory=deque)
    t_last: float = 0.0
    free_at: float = 0.0  # busy prefilling or stalled on a weight load until then
    epoch: int = 0  # invalidates scheduled events after a change
    busy_s: float = 0.0
    draining: bool = False


class _Simulation:
    def __init__(self, costs: Costs, work: Workload, setup: Setup):
        if setup.mode not in ("sync", "stream", "async"):
            raise ValueError(f"unknown mode {setup.mode!r}")
        if setup.update_mode not in ("keep", "interrupt", "drain"):
            raise ValueError(f"unknown update mode {setup.update_mode!r}")
        if setup.stale_groups not in ("drop", "drop_keep_slot", "train"):
            raise ValueError(f"unknown stale_groups {setup.stale_groups!r}")
        self.c, self.w, self.s = costs, work, setup
        self.rng = np.random.default_rng(setup.seed)
        self.pool = np.asarray(work.lengths, dtype=float)
        logs = np.log(self.pool)
        self.log_mean, self.log_std = float(logs.mean()), float(logs.std())
        self.engines = [_Engine() for _ in range(setup.engines)]
        self.loads = EngineLoads(setup.engines)
        self.policy = "longest_first" if setup.skew else "fifo"
        self.draws = self._draws()
        self.events: list = []
        self.now = 0.0
        self.seq = 0
        self.version = 0
        self.groups_made = 0
        self.trainer_free = True
        self.trainer_busy_s = 0.0
        self.steps_done = 0
        self.trained_samples = self.trained_tokens = 0
        self.staleness: list[int] = []
        self.dropped = 0
        # (time, engine busy s, trainer busy s, samples, tokens) where the measured window opens and closes
        self.window_start = self.window_end = (0.0, 0.0, 0.0, 0, 0)
        # sync / stream step state
        self.step_groups_left = 0
        self.stream_queue: list[_Group] = []
        self.stream_untrained = 0
        # async state
        self.gate_finished = self.gate_running = 0
        self.ready: list[tuple[int, int, _Group]] = []  # heap: oldest version first
        self.block: deque[_Group] = deque()

    # -- workload ---------------------------------------------------------------------
    def _draws(self):
        """Random numbers in chunks (one numpy call per chunk, not per group)."""
        n, rho = 1024, self.s.predictor_corr
        while True:
            true = self.rng.choice(self.pool, n)
            # correlation ρ with the true log length; no spread in the truth → a constant guess
            guess = np.exp(self.log_mean + rho * (np.log(true) - self.log_mean)
                           + math.sqrt(max(0.0, 1 - rho * rho)) * self.log_std * self.rng.standard_normal(n))
            sigma = self.w.within_group_sigma
            jitter = (self.rng.lognormal(0.0, sigma, (n, self.w.group_size)) if sigma > 0
                      else np.ones((n, self.w.group_size)))
            lengths = np.maximum(1, np.round(true[:, None] * jitter)).astype(int)
            yield from zip(guess.tolist(), lengths.tolist())

    def _new_group(self) -> _Group:
        guess, lengths = next(self.draws)
        g = _Group(self.groups_made, guess, lengths, version=self.version)
        self.groups_made += 1
        return g

    # -- events -------------------------------------------------------------------------
    def _push(self, t: float, kind: str, payload=None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def _step_time(self, e: _Engine) -> float:
        return self.c.decode_step_s + self.c.decode_per_seq_s * len(e.running)

    def _advance(self, e: _Engine, t: float) -> None:
        start = max(e.t_last, e.free_at)
        if e.running and t > start:
            e.progress += (t - start) / self._step_time(e)
            e.busy_s += t - start
        e.t_last = max(e.t_last, t)

    def _reschedule(self, i: int) -> None:
        e = self.engines[i]
        e.epoch += 1
        if e.running:
            start = max(e.t_last, e.free_at)
            t = start + max(0.0, e.running[0][0] - e.progress) * self._step_time(e)
            self._push(t, "engine", (i, e.epoch))

    def _stall(self, e: _Engine, seconds: float, busy: bool) -> None:
        e.free_at = max(e.free_at, self.now) + seconds
        if busy:
            e.busy_s += seconds

    def _admit(self, e: _Engine) -> None:
        prefill_tokens = 0
        while e.waiting and len(e.running) < self.c.max_seqs and not e.draining:
            r = e.waiting.popleft()
            r.start_progress = e.progress
            self.seq += 1
            heapq.heappush(e.running, (e.progress + r.length, self.seq, r))
            prefill_tokens += self.w.prompt_tokens
        if prefill_tokens:
            self._stall(e, prefill_tokens * self.c.prefill_per_token_s, busy=True)

    def _dispatch(self, g: _Group, i: int) -> None:
        e = self.engines[i]
        self._advance(e, self.now)
        g.left = self.w.group_size
        self.loads.start(i, g.predicted * self.w.group_size)
        e.waiting.extend(_Request(g, n) for n in g.lengths)
        self._admit(e)
        self._reschedule(i)

    def _on_engine(self, i: int) -> None:
        """The engine's earliest sequence is due now (it may also be others')."""
        e = self.engines[i]
        self._advance(e, self.now)
        # Float time can land a hair short of the finish; it was scheduled for now, so it is done.
        e.progress = max(e.progress, e.running[0][0])
        while e.running and e.running[0][0] <= e.progress + 1e-9:
            _, _, r = heapq.heappop(e.running)
            g = r.group
            g.left -= 1
            g.tokens += r.length + self.w.prompt_tokens
            if g.left == 0:
                self.loads.finish(i, g.predicted * self.w.group_size)
                self._group_done(g)
        if e.draining and not e.running:
            e.draining = False
            self._stall(e, self.c.load_s, busy=False)
        self._admit(e)
        self._reschedule(i)

    # -- trainer -------------------------------------------------------------------------
    def _train(self, groups: list[_Group], step_end: bool) -> None:
        tokens = sum(g.tokens for g in groups)
        seconds = tokens * self.c.train_per_token_s + (self.c.train_step_s if step_end else 0.0)
        self.trainer_free = False
        self.trainer_busy_s += seconds
        self.staleness += [self.version - g.version for g in groups]
        self.trained_samples += len(groups) * self.w.group_size
        self.trained_tokens += tokens
        self._push(self.now + seconds, "trained", step_end)

    def _on_trained(self, step_end: bool) -> None:
        self.trainer_free = True
        if not step_end:
            self._stream_next()
            return
        self.steps_done += 1
        self.version += 1
        if self.steps_done == self.s.warmup_steps:
            self._open_window()
        if self.steps_done >= self.s.steps:
            self._close_window()
            return
        self.trainer_free = False  # sending weights
        if self.s.mode == "async":
            self._update_engines()
        self._push(self.now + self.c.sync_s, "synced")

    def _on_synced(self) -> None:
        self.trainer_free = True
        if self.s.mode == "async":
            self._fill()
            self._try_async_step()
        else:
            self._start_sync_step()

    # -- sync and stream ------------------------------------------------------------------
    def _start_sync_step(self) -> None:
        groups = [self._new_group() for _ in range(self.w.batch_prompts)]
        self.step_groups_left = self.stream_untrained = len(groups)
        loads = self.loads.tokens if self.s.skew else self.loads.groups
        for index, engine in plan_dispatch(self.policy, [g.predicted for g in groups], loads):
            self._dispatch(groups[index], engine)

    def _stream_next(self) -> None:
        """Train a micro-batch once enough tokens wait, or the rest once generation is over."""
        if not self.trainer_free or not self.stream_queue:
            return
        queued = sum(g.tokens for g in self.stream_queue)
        if queued < self.w.micro_batch_tokens and self.step_groups_left:
            return
        batch, self.stream_queue = self.stream_queue, []
        self.stream_untrained -= len(batch)
        self._train(batch, step_end=self.stream_untrained == 0)

    # -- async ----------------------------------------------------------------------------
    def _capacity(self) -> int:
        return (self.s.max_staleness + self.version + 1) * self.w.batch_prompts

    def _fill(self) -> None:
        """Admit groups while the staleness bound allows (StalenessGate's rule)."""
        while self.gate_finished + self.gate_running < self._capacity():
            if not self.block:
                block = [self._new_group() for _ in range(self.w.batch_prompts)]
                self.block.extend(block[i] for i in dispatch_order(self.policy, [g.predicted for g in block]))
            g = self.block.popleft()
            g.version = self.version
            self.gate_running += 1
            self._dispatch(g, self.loads.pick(self.policy))

    def _try_async_step(self) -> None:
        if not self.trainer_free or len(self.ready) < self.w.batch_prompts:
            return
        batch, dropped = [], 0
        while self.ready and len(batch) < self.w.batch_prompts:
            _, _, g = heapq.heappop(self.ready)  # oldest first, as the controller does
            if self.version - g.version > self.s.max_staleness and self.s.stale_groups != "train":
                dropped += 1
            else:
                batch.append(g)
        self.dropped += dropped
        if dropped and self.s.stale_groups == "drop":
            self.gate_finished -= dropped
            self._fill()
        if len(batch) < self.w.batch_prompts:
            for g in batch:  # not enough yet: put them back
                heapq.heappush(self.ready, (g.version, g.index, g))
            return
        self._train(batch, step_end=True)

    def _update_engines(self) -> None:
        for i, e in enumerate(self.engines):
            self._advance(e, self.now)
            if self.s.update_mode == "keep":
                self._stall(e, self.c.load_s, busy=False)
            elif self.s.update_mode == "interrupt":
                # abort, load, resubmit prompt + tokens so far: the prefix is prefilled again
                recompute = sum(self.w.prompt_tokens + e.progress - r.start_progress for _, _, r in e.running)
                self._stall(e, self.c.load_s, busy=False)
                self._stall(e, recompute * self.c.prefill_per_token_s, busy=True)
            elif e.running:
                e.draining = True  # load once the running requests are done
            else:
                self._stall(e, self.c.load_s, busy=False)
            self._reschedule(i)

    # -- both -------------------------------------------------------------------------------
    def _group_done(self, g: _Group) -> None:
        if self.s.mode == "async":
            self.gate_running -= 1
            self.gate_finished += 1
            heapq.heappush(self.ready, (g.version, g.index, g))
            self._try_async_step()
            return
        self.step_groups_left -= 1
        self.stream_queue.append(g)
        if self.s.mode == "stream" or self.step_groups_left == 0:
            self._stream_next()  # sync: the whole batch at once, as the last group is in

    def _engine_busy(self) -> float:
        for e in self.engines:
            self._advance(e, self.now)
        return sum(e.busy_s for e in self.engines)

    def _open_window(self) -> None:
        self.window_start = (self.now, self._engine_busy(), self.trainer_busy_s, self.trained_samples,
                             self.trained_tokens)

    def _close_window(self) -> None:
        self.window_end = (self.now, self._engine_busy(), self.trainer_busy_s, self.trained_samples,
                           self.trained_tokens)

    def run(self) -> SimResult:
        if self.s.warmup_steps >= self.s.steps:
            raise ValueError("steps must exceed warmup_steps")
        if self.s.warmup_steps == 0:
            self._open_window()
        if self.s.mode == "async":
            self._fill()
        else:
            self._start_sync_step()
        while self.events and self.steps_done < self.s.steps:
            t, _, kind, payload = heapq.heappop(self.events)
            self.now = t
            if kind == "engine":
                i, epoch = payload
                if epoch == self.engines[i].epoch:
                    self._on_engine(i)
            elif kind == "trained":
                self._on_trained(payload)
            else:
                self._on_synced()
        if self.steps_done < self.s.steps:
            raise RuntimeError(f"the schedule stalled after {self.steps_done} steps "
                               f"({self.dropped} groups dropped as too stale)")
        t0, eb0, tb0, s0, k0 = self.window_start
        t1, eb1, tb1, s1, k1 = self.window_end
        span = t1 - t0
        return SimResult(
            samples_per_s=(s1 - s0) / span, tokens_per_s=(k1 - k0) / span,
            gen_idle=min(1.0, max(0.0, 1 - (eb1 - eb0) / (span * len(self.engines)))),
            train_idle=min(1.0, max(0.0, 1 - (tb1 - tb0) / span)),
            staleness_mean=float(np.mean(self.staleness)) if self.staleness else 0.0,
            dropped_groups=self.dropped, seconds=self.now, steps=self.steps_done,
        )


def simulate(costs: Costs, work: Workload, setup: Setup) -> SimResult:
    return _Simulation(costs, work, setup).run()


def setup_for(mode: str, **kw) -> Setup:
    """A ``Setup`` for one of ``MODES`` ("async+skew" = async with longest-first dispatch)."""
    base, _, extra = mode.partition("+")
    return Setup(mode=base, skew=extra == "skew", **kw)


def compare(costs: Costs, work: Workload, engines: int, modes: Sequence[str] = MODES, **setup_kw) -> dict[str, SimResult]:
    return {m: simulate(costs, work, setup_for(m, engines=engines, **setup_kw)) for m in modes}


# -- length distributions ----------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def chain_lengths(n: int = 4000, seed: int = 0, mean: Optional[float] = None, cap: int = 48,
                  **chain_params) -> tuple[int, ...]:
    """Completion lengths of the ``chain`` task (answer + EOS), optionally rescaled to a mean."""
    from workers.tasks.datasets import gen_chain

    raw = np.array([len(r["answer"]) + 1 for r in gen_chain(n, seed=seed, **chain_params)], dtype=float)
    if mean is not None:
        raw *= mean / raw.mean()
    return tuple(int(x) for x in np.clip(np.round(raw), 1, cap))


def lognormal_lengths(median: float, sigma: float, cap: int, n: int = 4000, seed: int = 0) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(x) for x in np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), 1, cap))




# -- cluster scale ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. Defaults: H100 SXM, 400 Gb/s-class network."""
    memory_bytes: float = 80e9
    hbm_bytes_per_s: float = 3.35e12
    bf16_flops: float = 989e12
    train_mfu: float = 0.40  # model FLOPs utilisation of training
    decode_bw_efficiency: float = 0.6  # share of HBM bandwidth a decode step achieves
    decode_flops_efficiency: float = 0.5
    network_bytes_per_s: float = 50e9  # weight broadcast trainer → engines
    max_seqs: int = 256  # vLLM's default max_num_seqs


def cluster_costs(params: float, rollout_gpus: int, trainer_gpus: int, work: Workload,
                  hw: Hardware = Hardware()) -> Optional[tuple[Costs, int]]:
    """Costs and engine count for a dense bf16 model of ``params`` parameters, or None
    when the split cannot hold the model.

    Assumptions (standard first-order scaling):
    - an engine uses the fewest GPUs (tensor parallel, power of two, ≤ 8) whose memory
      holds the weights in half of it, the rest is KV cache;
    - decode step = weights read once (2·P bytes / bandwidth) + per sequence its KV read
      (≈ 6e-6·P bytes a token of context, GQA-sized) and 2·P FLOPs;
    - prefill: 2·P FLOPs a token; training: 8·P FLOPs a token (6·P forward+backward,
      2·P for the proximal log-probs) at ``train_mfu``; the trainer needs ≈ 18 bytes a
      parameter (bf16 weights and grads, fp32 Adam and master) in 80 % of its memory;
    - a weight update moves 2·P bytes over the network; engines stall for as long.
    """
    weights = 2.0 * params
    tp = 1
    while weights > 0.5 * tp * hw.memory_bytes:
        tp *= 2
    if tp > 8 or rollout_gpus < tp or 18 * params > 0.8 * trainer_gpus * hw.memory_bytes:
        return None
    mean_len = float(np.mean(work.lengths))
    kv_per_token = 6e-6 * params
    context = work.prompt_tokens + mean_len / 2
    bandwidth = tp * hw.hbm_bytes_per_s * hw.decode_bw_efficiency
    per_seq = kv_per_token * context / bandwidth + 2 * params / (tp * hw.bf16_flops * hw.decode_flops_efficiency)
    kv_room = tp * hw.memory_bytes * 0.9 - weights
    max_seqs = int(max(1, min(hw.max_seqs, kv_room / (kv_per_token * (work.prompt_tokens + mean_len)))))
    sync = weights / hw.network_bytes_per_s + 0.1
    costs = Costs(
        decode_step_s=weights / bandwidth, decode_per_seq_s=per_seq,
        prefill_per_token_s=2 * params / (tp * hw.bf16_flops * hw.decode_flops_efficiency),
        train_per_token_s=8 * params / (trainer_gpus * hw.bf16_flops * hw.train_mfu),
        train_step_s=18 * params / (trainer_gpus * hw.hbm_bytes_per_s) + 0.5,
        sync_s=sync, load_s=sync, max_seqs=max_seqs,
    )
    return costs, rollout_gpus // tp


GPUS_PER_NODE = 8


def planned_resources(params: float, gpus: int, rollout_gpus: int, work: "Workload",
                      hw: "Hardware" = None, gpus_per_node: int = GPUS_PER_NODE) -> Optional[dict]:
    """The run spec's ``rollout.engines`` and ``resources`` for a split, if the placement
    planner (workers/cluster/placement.py) can place it on nodes of ``gpus_per_node`` GPUs: whole
    engines per node, trainer ranks split evenly over the nodes. None otherwise."""
    from workers.cluster.placement import Machine, PlacementError, plan_placement
    from workers.spec import SpecError, validate_spec

    sized = cluster_costs(params, rollout_gpus, gpus - rollout_gpus, work, hw or Hardware())
    if sized is None:
        return None
    engines = sized[1]
    tp = rollout_gpus // max(1, engines)
    nodes = max(1, -(-gpus // gpus_per_node))
    resources = {"queue": "gpu", "nodes": nodes, "gpus_per_node": min(gpus, gpus_per_node),
                 "trainer_ranks": gpus - engines * tp, "tensor_parallel": tp}
    try:
        spec = validate_spec({"name": "plan", "model": {"path": "m"}, "task": {"dataset": "gen:add"},
                              "rollout": {"engines": engines}, "resources": resources})
        plan_placement(spec, Machine(cpu_cores=64, gpus_per_node=min(gpus, gpus_per_node), gpu_memory_gib=80))
    except (PlacementError, SpecError):
        return None
    return {"rollout": {"engines": engines}, "resources": resources}


def split_candidates(gpus: int, shares: int = 8) -> list[int]:
    """Rollout GPU counts to try: every 1/shares of the cluster (all of them on small ones)."""
    return sorted({max(1, round(gpus * k / shares)) for k in range(1, shares)} - {gpus})


def recommend(params: float, gpu_counts: Sequence[int], work: Workload, setup_kw: Optional[dict] = None,
              hw: Hardware = Hardware()) -> list[dict]:
    """Per cluster size: every mode's throughput at every feasible split (eighths of the
    cluster, then halfway to the neighbours of the best), the best split per mode, and
    sync colocated (every GPU generates, then every GPU trains)."""
    setup_kw = setup_kw or {}
    out = []
    for gpus in gpu_counts:
        curves: dict[str, list[tuple[int, SimResult]]] = {m: [] for m in MODES}

        def measure(rollouts) -> None:
            for rollout in rollouts:
                sized = cluster_costs(params, rollout, gpus - rollout, work, hw)
                # only splits the placement planner can lay out on 8-GPU nodes
                if sized is not None and planned_resources(params, gpus, rollout, work, hw) is not None:
                    for mode, result in compare(sized[0], work, sized[1], **setup_kw).items():
                        curves[mode].append((rollout, result))

        coarse = split_candidates(gpus)
        measure(coarse)
        if any(curves.values()):
            _, (top, _) = best_of(curves)
            k = coarse.index(top)
            near = {(top + coarse[j]) // 2 for j in (k - 1, k + 1) if 0 <= j < len(coarse)}
            measure(sorted(near - set(coarse)))
        for curve in curves.values():
            curve.sort(key=lambda rc: rc[0])
        colocated = cluster_costs(params, gpus, gpus, work, hw)
        colocated_sync = (simulate(colocated[0], work, setup_for("sync", engines=colocated[1], **setup_kw))
                          if colocated else None)
        best = {m: max(c, key=lambda rc: rc[1].samples_per_s) for m, c in curves.items() if c}
        out.append({"gpus": gpus, "curves": curves, "best": best, "colocated_sync": colocated_sync})
    return out


def best_of(curves: dict[str, list[tuple[int, SimResult]]]) -> tuple[str, tuple[int, SimResult]]:
    """The (mode, (rollout GPUs, result)) with the highest samples/s."""
    return max(((m, rc) for m, c in curves.items() for rc in c), key=lambda mrc: mrc[1][1].samples_per_s)
