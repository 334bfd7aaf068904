"""Discrete-event simulator of RL training: where does the time go at cluster scale?

    .venv/bin/python bench/simulator.py                       # the modes side by side, one setup
    .venv/bin/python bench/simulator.py --calibrate           # fit costs to bench/results/sync_vs_async.json
    .venv/bin/python bench/simulator.py --recommend --model-size 7e9 --gpus 8..256

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
  ``workers.scheduling``'s ``longest_first`` on lengths predicted with correlation
  ``predictor_corr`` (log space) to the truth, instead of FIFO on count-balanced engines.

Throughput is trained samples/s between the end of step ``warmup_steps`` and the last.
"""
from __future__ import annotations

import argparse
import functools
import heapq
import json
import math
import sys
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make ``workers`` importable
    sys.path.insert(0, str(ROOT))

from workers.scheduling import EngineLoads, dispatch_order, plan_dispatch  # noqa: E402

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
    from workers.tasks import gen_chain

    raw = np.array([len(r["answer"]) + 1 for r in gen_chain(n, seed=seed, **chain_params)], dtype=float)
    if mean is not None:
        raw *= mean / raw.mean()
    return tuple(int(x) for x in np.clip(np.round(raw), 1, cap))


def lognormal_lengths(median: float, sigma: float, cap: int, n: int = 4000, seed: int = 0) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(x) for x in np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), 1, cap))


# -- calibration against the CPU runs ------------------------------------------------------
# bench/sync_vs_async.py's setup. On the CPU, sync gives each phase the whole machine in
# turn; async gives rollout and trainer half the cores each (workers/placement.py).
CPU_CHAIN = {"max_value": 10, "max_terms": 12}
CPU_WORKLOAD = {"group_size": 8, "batch_prompts": 8, "micro_batch_tokens": 4096}
CPU_MAX_TOKENS = 48
CPU_MAX_STALENESS = 2
# Assumed, not fitted: how much slower a role runs on half of the cores. Small models
# parallelise poorly over threads, so well under the 2× of perfect scaling.
HALF_CORES_SLOWDOWN = 1.5
# Shape of the decode cost: docs/architecture.md §4 records 64 prompts × 16 tokens ≈ 0.14 s
# (≈ 8.75 ms a step at batch 64); assumed half fixed, half per sequence; a prefill token
# costs a quarter of a decode slot. Calibration fits one scale for all three.
CPU_DECODE = (4.4e-3, 4.4e-3 / 64, 4.4e-3 / 64 / 4)


@functools.lru_cache(maxsize=1)
def _cpu_prompt_tokens() -> int:
    from workers.tasks import gen_chain

    rows = gen_chain(2000, seed=0, **CPU_CHAIN)
    return round(sum(len(r["prompt"]) for r in rows) / len(rows))


def cpu_prediction(run: dict, gen_scale: float, train_per_token_s: float, steps: int = 12) -> float:
    """Simulated samples/s of one measured CPU run, given the two fitted costs."""
    slowdown = 1.0 if run["mode"] == "sync" else HALF_CORES_SLOWDOWN
    a, b, p = (x * gen_scale * slowdown for x in CPU_DECODE)
    costs = Costs(a, b, p, train_per_token_s * slowdown, sync_s=run["sync_ms"] / 1000, load_s=run["load_ms"] / 1000)
    work = Workload(lengths=chain_lengths(mean=float(run["len_mean"]), cap=CPU_MAX_TOKENS, **CPU_CHAIN),
                    prompt_tokens=_cpu_prompt_tokens(), **CPU_WORKLOAD)
    if run["mode"] == "sync":
        setup = Setup(mode="sync", steps=steps)
    else:
        setup = Setup(mode="async", update_mode=run["mode"], max_staleness=CPU_MAX_STALENESS, steps=steps,
                      stale_groups="drop_keep_slot")  # what the controller does
    return simulate(costs, work, setup).samples_per_s


def calibrate(runs: Sequence[dict], points: int = 7, tol: float = 0.01, steps: int = 12) -> dict:
    """Fit the decode-cost scale and the per-token training cost to measured runs.

    Least squares on log(samples/s) over every run: a coarse ``points``×``points`` grid
    in log space (±e^6 around gen scale 1 and 0.1 ms a trained token), then a pattern
    search (8 directions) from its best point until the step is below ``tol`` (two parameters: no
    optimiser library needed). Returns the fit and predicted vs measured per run.
    """
    def predict(run: dict, p: tuple[float, float]) -> float:
        return cpu_prediction(run, math.exp(p[0]), math.exp(p[1]), steps)

    @functools.lru_cache(maxsize=None)
    def loss(p: tuple[float, float]) -> float:
        return sum((math.log(predict(r, p)) - math.log(r["samples_per_s"])) ** 2 for r in runs)

    half, span, centre = max(1, points // 2), 6.0, (0.0, math.log(1e-4))
    grid = [(centre[0] + span * i / half, centre[1] + span * j / half)
            for i in range(-half, half + 1) for j in range(-half, half + 1)]
    best, step = min(grid, key=loss), span / half / 2

    def in_box(p: tuple[float, float]) -> tuple[float, float]:  # a cost → 0 fits nothing physical
        return tuple(min(c + span, max(c - span, v)) for c, v in zip(centre, p))

    while step >= tol:
        # diagonals too: async throughput is a min() of two bounds, its valleys run diagonally
        moves = [in_box((best[0] + dx * step, best[1] + dy * step)) for dx in (-1, 0, 1) for dy in (-1, 0, 1) if dx or dy]
        better = min(moves, key=loss)
        if loss(better) < loss(best):
            best = better
        else:
            step /= 2
    gen_scale, train_s = math.exp(best[0]), math.exp(best[1])
    return {"gen_scale": gen_scale, "decode_step_s": CPU_DECODE[0] * gen_scale,
            "decode_per_seq_s": CPU_DECODE[1] * gen_scale, "train_per_token_s": train_s,
            "rms_log_error": math.sqrt(loss(best) / len(runs)),
            "runs": [{"mode": r["mode"], "measured": r["samples_per_s"], "predicted": predict(r, best)} for r in runs]}


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
    planner (workers/placement.py) can place it on nodes of ``gpus_per_node`` GPUs: whole
    engines per node, trainer ranks split evenly over the nodes. None otherwise."""
    from workers.placement import Machine, PlacementError, plan_placement
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
            _, (top, _) = _best_of(curves)
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


def _best_of(curves: dict[str, list[tuple[int, SimResult]]]) -> tuple[str, tuple[int, SimResult]]:
    """The (mode, (rollout GPUs, result)) with the highest samples/s."""
    return max(((m, rc) for m, c in curves.items() for rc in c), key=lambda mrc: mrc[1][1].samples_per_s)


# -- plotting: a tiny SVG writer (no plotting library in the environment) ----------------------
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


@dataclass
class Series:
    label: str
    xs: list[float]
    ys: list[float]
    color: str
    dashed: bool = False
    mark: Optional[int] = None  # index of a point to ring (e.g. the best split)


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: list[Series]


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 × a power of ten apart) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / target
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)), key=lambda s: abs(s - raw))
    start = math.floor(lo / step) * step
    return [round(start + i * step, 10) for i in range(int(math.ceil((hi - start) / step)) + 1)]


def _fmt(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e4 else f"{v:.0e}"


def svg_chart(panels: list[Panel], title: str, width: int = 560, height: int = 420) -> str:
    """Line charts side by side, each with axes, ticks, grid and a legend."""
    from xml.sax.saxutils import escape

    left, right, top, bottom = 70, 20, 60, 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * len(panels)}" height="{height}" '
           f'font-family="Helvetica, Arial, sans-serif" font-size="12">',
           f'<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{width * len(panels) / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">'
           f'{escape(title)}</text>']
    for k, panel in enumerate(panels):
        x0, x1, y0, y1 = k * width + left, (k + 1) * width - right, height - bottom, top
        xs = [x for s in panel.series for x in s.xs]
        ys = [y for s in panel.series for y in s.ys] + [0.0]
        xt, yt = nice_ticks(min(xs), max(xs)), nice_ticks(0.0, max(ys) * 1.05)
        sx = lambda v: x0 + (v - xt[0]) / (xt[-1] - xt[0]) * (x1 - x0)  # noqa: E731
        sy = lambda v: y0 - (v - yt[0]) / (yt[-1] - yt[0]) * (y0 - y1)  # noqa: E731
        out.append(f'<text x="{(x0 + x1) / 2}" y="{top - 14}" text-anchor="middle" font-size="13">{escape(panel.title)}</text>')
        for v in xt:
            out.append(f'<line x1="{sx(v):.1f}" y1="{y0}" x2="{sx(v):.1f}" y2="{y1}" stroke="#e5e5e5"/>'
                       f'<text x="{sx(v):.1f}" y="{y0 + 16}" text-anchor="middle">{_fmt(v)}</text>')
        for v in yt:
            out.append(f'<line x1="{x0}" y1="{sy(v):.1f}" x2="{x1}" y2="{sy(v):.1f}" stroke="#e5e5e5"/>'
                       f'<text x="{x0 - 6}" y="{sy(v) + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
        out.append(f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="none" stroke="#444"/>')
        out.append(f'<text x="{(x0 + x1) / 2}" y="{height - 18}" text-anchor="middle">{escape(panel.xlabel)}</text>')
        out.append(f'<text transform="translate({k * width + 18},{(y0 + y1) / 2}) rotate(-90)" text-anchor="middle">'
                   f'{escape(panel.ylabel)}</text>')
        for j, s in enumerate(panel.series):
            points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(s.xs, s.ys))
            dash = ' stroke-dasharray="6,4"' if s.dashed else ""
            out.append(f'<polyline points="{points}" fill="none" stroke="{s.color}" stroke-width="2"{dash}/>')
            if len(s.xs) > 2:  # a measured curve, not a reference line
                out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{s.color}"/>' for x, y in zip(s.xs, s.ys)]
            if s.mark is not None:
                out.append(f'<circle cx="{sx(s.xs[s.mark]):.1f}" cy="{sy(s.ys[s.mark]):.1f}" r="6" fill="none" '
                           f'stroke="{s.color}" stroke-width="2"/>')
            ly = y1 + 14 + 16 * j
            out.append(f'<line x1="{x1 - 150}" y1="{ly - 4}" x2="{x1 - 128}" y2="{ly - 4}" stroke="{s.color}" '
                       f'stroke-width="2"{dash}/><text x="{x1 - 122}" y="{ly}">{escape(s.label)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def split_plot(params: float, report: list[dict], focus_gpus: int) -> str:
    """Left: the best mode's throughput per GPU against the rollout share, one line per
    cluster size, its optimum ringed. Right: every mode at one cluster size."""
    best_mode = "async+skew"
    left = []
    for k, row in enumerate(report):
        curve = row["curves"][best_mode]
        if not curve:
            continue
        xs = [r / row["gpus"] for r, _ in curve]
        ys = [res.samples_per_s / row["gpus"] for _, res in curve]
        left.append(Series(f"{row['gpus']} GPUs", xs, ys, PALETTE[k % len(PALETTE)], mark=ys.index(max(ys))))
    focus = next(r for r in report if r["gpus"] == focus_gpus)
    right = []
    for mode in MODES:
        curve = focus["curves"][mode]
        if curve:
            base, _, skew = mode.partition("+")
            ys = [res.samples_per_s for _, res in curve]
            right.append(Series(mode, [r / focus_gpus for r, _ in curve], ys, PALETTE[("sync", "stream", "async").index(base)],
                                dashed=bool(skew), mark=ys.index(max(ys))))
    if focus["colocated_sync"] is not None and right:
        flat = focus["colocated_sync"].samples_per_s
        right.append(Series("sync colocated", [right[0].xs[0], right[0].xs[-1]], [flat, flat], "#000000", dashed=True))
    return svg_chart([Panel(f"{best_mode}, by cluster size", "share of GPUs generating", "samples/s per GPU", left),
                      Panel(f"every mode, {focus_gpus} GPUs", "share of GPUs generating", "samples/s", right)],
                     f"Rollout/trainer split for a {params / 1e9:g}B model (simulated)", width=560)


# -- command line -------------------------------------------------------------------------------
def parse_gpus(text: str) -> list[int]:
    """"8..256" → powers of two from 8 to 256; "8,24,64" → those; "64" → [64]."""
    if ".." in text:
        lo, hi = (int(x) for x in text.split(".."))
        out, g = [], lo
        while g <= hi:
            out.append(g)
            g *= 2
        return out
    return [int(x) for x in text.split(",")]


def _row(label: str, r: SimResult) -> str:
    return (f"{label:<26} {r.samples_per_s:>10.3f} {r.gen_idle:>9.2f} {r.train_idle:>10.2f} "
            f"{r.staleness_mean:>6.2f} {r.dropped_groups:>5}")


HEADER = f"{'':<26} {'samples/s':>10} {'gen idle':>9} {'train idle':>10} {'stale':>6} {'drops':>5}"


def _workload(args) -> Workload:
    return Workload(lengths=lognormal_lengths(args.median_len, args.sigma, args.max_tokens, seed=args.seed),
                    prompt_tokens=args.prompt_tokens, group_size=args.group_size, batch_prompts=args.batch_prompts,
                    micro_batch_tokens=args.micro_batch_tokens)


def _setup_kw(args) -> dict:
    return {"predictor_corr": args.predictor_corr, "max_staleness": args.max_staleness, "steps": args.steps,
            "warmup_steps": args.warmup_steps, "seed": args.seed, "stale_groups": args.stale_groups}


def main_calibrate(args) -> None:
    path = Path(args.measured)
    if not path.is_file():
        raise SystemExit(f"{path} does not exist yet: run bench/sync_vs_async.py first")
    runs = json.loads(path.read_text())
    fit = calibrate(runs)
    print(f"fitted on {len(runs)} CPU runs ({path}); assumed: async roles run {HALF_CORES_SLOWDOWN}× slower on half the cores")
    print(f"  decode step = {fit['decode_step_s'] * 1e3:.2f} ms + {fit['decode_per_seq_s'] * 1e3:.3f} ms × batch, "
          f"training = {fit['train_per_token_s'] * 1e3:.3f} ms a token, rms log error {fit['rms_log_error']:.3f}")
    print(f"{'mode':<10} {'measured':>9} {'predicted':>9} {'error':>7}")
    for r in fit["runs"]:
        print(f"{r['mode']:<10} {r['measured']:>9.2f} {r['predicted']:>9.2f} {r['predicted'] / r['measured'] - 1:>+7.0%}")


def main_recommend(args, gpu_counts: list[int]) -> None:
    work = _workload(args)
    report = recommend(args.model_size, gpu_counts, work, _setup_kw(args))
    print(f"{args.model_size / 1e9:g}B model; {args.batch_prompts} prompts × {args.group_size} a step; lengths lognormal "
          f"median {args.median_len:g}, σ {args.sigma:g}, ≤ {args.max_tokens} (mean {np.mean(work.lengths):.0f}); "
          f"predictor ρ {args.predictor_corr:g}; η {args.max_staleness}")
    print(f"{'GPUs':>5} {'recommended split':>20} {'samples/s':>10}  " + "  ".join(f"{m + ' best':>18}" for m in MODES)
          + f"  {'sync colocated':>14}")
    for row in report:
        if not row["best"]:
            print(f"{row['gpus']:>5}  cannot hold the model")
            continue
        mode, (rollout, res) = _best_of(row["curves"])
        cells = "  ".join(f"{row['best'][m][1].samples_per_s:>8.2f} @{row['best'][m][0]:>3}/{row['gpus'] - row['best'][m][0]:<4}"
                          if m in row["best"] else f"{'-':>18}" for m in MODES)
        colocated = f"{row['colocated_sync'].samples_per_s:>14.2f}" if row["colocated_sync"] else f"{'-':>14}"
        split = f"{rollout} gen / {row['gpus'] - rollout} train"
        if row["colocated_sync"] and row["colocated_sync"].samples_per_s > res.samples_per_s:
            mode, split, res = "sync colocated", "all GPUs, in turn", row["colocated_sync"]
        print(f"{row['gpus']:>5} {split:>20} {res.samples_per_s:>10.2f}  "
              f"{cells}  {colocated}   ({mode})")
        planned = planned_resources(args.model_size, row["gpus"], rollout, work)
        if planned is not None and mode != "sync colocated":
            print(f"{'':>5} spec: rollout: {json.dumps(planned['rollout'])}, resources: "
                  f"{json.dumps(planned['resources'])}")
    feasible = [r["gpus"] for r in report if r["best"]]
    if feasible and args.plot:
        focus = feasible[len(feasible) // 2]
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        Path(args.plot).write_text(split_plot(args.model_size, report, focus))
        print(f"plot: {args.plot}")


def main_compare(args, gpus: int) -> None:
    work = _workload(args)
    rollout = args.rollout_gpus or gpus // 2
    sized = cluster_costs(args.model_size, rollout, gpus - rollout, work)
    if sized is None:
        raise SystemExit(f"{rollout} rollout / {gpus - rollout} trainer GPUs cannot hold a {args.model_size:g} model")
    print(f"{args.model_size / 1e9:g}B model, {rollout} rollout GPUs ({sized[1]} engines) / {gpus - rollout} trainer GPUs")
    print(HEADER)
    for mode, r in compare(sized[0], work, sized[1], **_setup_kw(args)).items():
        print(_row(mode, r))


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recommend", action="store_true", help="sweep the rollout/trainer split per cluster size")
    p.add_argument("--calibrate", action="store_true", help="fit costs to the measured CPU runs")
    p.add_argument("--measured", default=str(ROOT / "bench" / "results" / "sync_vs_async.json"))
    p.add_argument("--model-size", type=float, default=7e9, help="parameters")
    p.add_argument("--gpus", default="64", help='"64", "8,32,64" or "8..256" (powers of two)')
    p.add_argument("--rollout-gpus", type=int, default=0, help="without --recommend: GPUs generating (default half)")
    p.add_argument("--batch-prompts", type=int, default=512)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--median-len", type=float, default=1024)
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal spread of completion lengths")
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--micro-batch-tokens", type=int, default=262144, help="stream mode's training micro-batch")
    p.add_argument("--predictor-corr", type=float, default=0.8, help="ranker quality for +skew (log-space correlation)")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--stale-groups", choices=("train", "drop", "drop_keep_slot"), default="train",
                   help="async: what happens to a group older than --max-staleness (see Setup)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=str(ROOT / "bench" / "results" / "split.svg"))
    args = p.parse_args(argv)
    if args.calibrate:
        main_calibrate(args)
    elif args.recommend:
        main_recommend(args, parse_gpus(args.gpus))
    else:
        main_compare(args, parse_gpus(args.gpus)[0])


if __name__ == "__main__":
    main()
