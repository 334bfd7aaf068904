"""Rollout worker: one vLLM ``AsyncLLM`` engine that generates completions with
behaviour log-probs and takes new weights while requests are in flight. Generation is
here; the vLLM engine's arguments, calls and sleep are in engine_lifecycle.py, its weight
updates in engine_updates.py.

Update modes (``rollout.update_mode``):
- ``keep`` (PipelineRL): pause the scheduler keeping requests and KV cache, load,
  label the new version, resume. The four engine calls are sent back to back without
  waiting for each other: the engine handles them in order, so loading happens while
  paused, and the generation stall is the load itself, not four round trips plus the
  client-side sleep that ``AsyncLLM.pause_generation`` adds.
- ``interrupt`` (AReaL): abort in-flight requests, load, resubmit each as prompt +
  tokens so far with the remaining budget; the kept prefix keeps its old labels.
- ``drain``: stop admitting, let running requests finish, then load ("update between
  requests", the conventional asynchronous baseline).
Every token's producing version comes from the engine itself (vLLM labels each output
step with the engine's weight version), so labels are exact across an update.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from workers.rollout.engine_args import LORA_ID, priority_kwargs
from workers.rollout.engine_types import Completion, SamplingOptions, UpdateTiming, delta_logprobs, extend_track
from workers.rollout.engine_updates import EngineUpdates
from workers.rollout.staleness import VersionTrack
from workers.tasks.model_folder import check_model_folder
from workers.weights.update import WeightUpdate

if TYPE_CHECKING:
    from workers.rollout.messages import EngineServerConfig

_ids = itertools.count()


async def continue_on(engine: "RolloutEngine", done: Completion, max_tokens: int, temperature: float,
                      ignore_eos: bool = False) -> Completion:
    """Finish on ``engine`` a sequence another engine handed off: prompt + tokens so far
    as the new prompt, the remaining budget, and one completion stitched together."""
    rest = await engine.generate(done.prompt_ids + done.token_ids, max_tokens - done.length, temperature,
                                 ignore_eos=ignore_eos)
    track = VersionTrack()
    for version, n in done.versions.runs + rest.versions.runs:
        track.add(version, n)
    return Completion(done.prompt_ids, done.token_ids + rest.token_ids, done.logprobs + rest.logprobs, track,
                      rest.finish_reason, done.start_version, done.started_at, rest.finished_at,
                      done.resubmits + rest.resubmits + 1, rest.engine)


class RolloutEngine(EngineUpdates):
    # called with True when a request starts on an idle engine, False when its last one stops
    # (the run's time breakdown, workers/coord/time_breakdown.py)
    on_busy: Optional[Callable[[bool], None]] = None

    def __init__(self, model_path: str, *, index: int = 0, update_mode: str = "keep", max_model_len: int = 256,
                 max_num_seqs: int = 256, dtype: str = "float32", seed: int = 0, rpc_timeout_s: float = 60.0,
                 sampling: SamplingOptions = SamplingOptions(), gpu_memory_utilization: Optional[float] = None,
                 cpu_single_process: bool = False, enforce_eager: Optional[bool] = None, sleep_mode: bool = False,
                 tensor_parallel: int = 1, priority_scheduling: bool = False, lora_rank: Optional[int] = None):
        # model.lora: the policy is the base model plus an adapter of this rank, served as a
        # vLLM LoRA (enable_lora); every weight update is the adapter, loaded into its slot in place
        self.lora_rank = lora_rank
        self.lora_slots = 1  # vLLM's max_loras (a shared pool: workers/rollout/pool.py)
        self.lora_id = LORA_ID  # this policy's adapter's slot
        self.lora_request = None  # the adapter requests generate with, once the first one is loaded
        self._lora_folder: Optional[str] = None
        self._update_lock: Optional[asyncio.Lock] = None  # shared by the runs of a pool's engine
        # vLLM's priority scheduler (schedule.dispatch skew_aware): each request's priority
        # orders the engine's queue instead of arrival alone
        self.priority_scheduling = priority_scheduling
        self.tensor_parallel = tensor_parallel  # resources.tensor_parallel: vLLM workers the model is sharded over
        self.enforce_eager = enforce_eager  # rollout.enforce_eager (None: by device)
        self.sleep_mode = sleep_mode  # colocated GPU plans: vLLM sleep mode (sleep/wake_up around trainer steps)
        self.asleep: Optional[str] = None  # what sleeps now: "all" or "kv_cache"; None when awake
        self.gpu_memory_utilization = gpu_memory_utilization  # the plan's share of the GPU (None: vLLM's default)
        self.cpu_single_process = cpu_single_process  # rollout.cpu_single_process
        self.model_path, self.index, self.update_mode = model_path, index, update_mode
        self.sampling = sampling
        self.rpc_timeout_s = rpc_timeout_s
        self.max_model_len, self.max_num_seqs, self.dtype, self.seed = max_model_len, max_num_seqs, dtype, seed
        self.engine: Any = None  # vLLM's AsyncLLM, once started
        self.version = 0
        self.active: dict[str, float] = {}  # request id -> time of its last output
        self.updates: list[UpdateTiming] = []
        self.generated_tokens = 0
        self.busy_s = 0.0  # time with at least one request running (for idle fractions)
        self._busy_since: Optional[float] = None
        self._resume = asyncio.Event()
        self._resume.set()
        self._interrupted: set[str] = set()
        self._handed_off: set[str] = set()  # aborted to be continued on another engine
        self._grouped: set[str] = set()  # keys in ``active`` of the samples of group requests
        self._gap_ema: Optional[float] = None
        self._pending_stall: Optional[tuple[UpdateTiming, float, dict[str, float]]] = None

    @classmethod
    def from_config(cls, config: "EngineServerConfig") -> "RolloutEngine":
        """The engine an engine server's configuration describes (in this process)."""
        return cls(config.model_path, index=config.index, update_mode=config.update_mode,
                   max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs, dtype=config.dtype,
                   seed=config.seed, rpc_timeout_s=config.rpc_timeout_s,
                   sampling=SamplingOptions(config.top_p, config.top_k, tuple(config.stop),
                                            tuple(config.stop_token_ids)),
                   gpu_memory_utilization=config.gpu_memory_utilization,
                   cpu_single_process=config.cpu_single_process, enforce_eager=config.enforce_eager,
                   sleep_mode=config.sleep_mode, tensor_parallel=config.tensor_parallel,
                   priority_scheduling=config.priority_scheduling, lora_rank=config.lora_rank)

    # -- lifecycle ---------------------------------------------------------------
    async def start(self, weights: Optional[WeightUpdate] = None, version: int = 0) -> None:
        """Start the engine; ``weights`` (a file or bytes: weights/update.py) are loaded as
        its first weight update, labelled ``version`` (a resumed run's checkpoint)."""
        if not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise FileNotFoundError(f"model.path {self.model_path!r} is not a Hugging Face model folder (no config.json)")
        check_model_folder(self.model_path)  # vLLM reads the folder's index and config as transformers does
        from vllm.v1.engine.async_llm import AsyncLLM

        args = self.engine_args()
        # vLLM's CPU platform turns the uni executor into a worker process unless this is 0
        # when the config is made; the engine core process it starts inherits it.
        before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        if self.cpu_single_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            self.engine = AsyncLLM.from_engine_args(args)
        finally:
            if before is None:
                os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before
        await self._set_label("0")
        # The first weight load and the first steps of a process are slow (warm-up): pay them now.
        await self.generate([1, 5], max_tokens=4, temperature=1.0)
        if weights is not None:
            await self._load(weights)
        if version:
            await self._set_label(str(version))
            self.version = version

    def busy_seconds(self, now: Optional[float] = None) -> float:
        """Time with at least one request running, the current stretch included."""
        now = time.perf_counter() if now is None else now
        running = now - self._busy_since if self._busy_since is not None else 0.0
        return self.busy_s + running

    # -- generation ----------------------------------------------------------------
    def _params(self, max_tokens: int, temperature: float, seed: Optional[int], ignore_eos: bool, n: int = 1):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        opts = self.sampling
        return SamplingParams(
            n=n, max_tokens=max_tokens, temperature=temperature, logprobs=0, seed=seed,
            top_p=opts.top_p, top_k=opts.top_k, stop=list(opts.stop) or None,
            stop_token_ids=list(opts.stop_token_ids) or None, include_stop_str_in_output=True,
            output_kind=RequestOutputKind.DELTA, skip_special_tokens=True,
            detokenize=bool(opts.stop),  # stop strings are matched on text; ids need none
            ignore_eos=ignore_eos,
        )

    def _running(self, key: str) -> None:
        """A sequence starts running (``active`` holds one key per running sequence)."""
        if not self.active:
            self._busy_since = time.perf_counter()
            if self.on_busy is not None:
                self.on_busy(True)
        self.active[key] = time.perf_counter()

    def _stopped(self, key: str) -> None:
        self.active.pop(key, None)
        self._grouped.discard(key)
        if not self.active and self._busy_since is not None:
            self.busy_s += time.perf_counter() - self._busy_since
            self._busy_since = None
            if self.on_busy is not None:
                self.on_busy(False)

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float,
                       seed: Optional[int] = None, ignore_eos: bool = False, priority: int = 0) -> Completion:
        """One sample. ``priority``: its place in vLLM's queue with priority scheduling
        (smaller first; ties by arrival)."""
        from vllm.inputs import TokensPrompt

        tokens: list[int] = []
        logprobs: list[float] = []
        track = VersionTrack()
        start_version, started, resubmits = self.version, time.time(), 0
        finish = "length"
        while True:
            await self._resume.wait()  # interrupt mode: do not resubmit into a half-loaded engine
            rid = f"e{self.index}-{next(_ids)}"
            params = self._params(max_tokens - len(tokens), temperature, seed, ignore_eos)
            self._running(rid)
            spans, seen = None, None
            died = False
            try:
                async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids + tokens), params,
                                                      request_id=rid, lora_request=self.lora_request,
                                                      **priority_kwargs(priority)):
                    c = out.outputs[0]
                    tokens += c.token_ids
                    logprobs += delta_logprobs(c)
                    self.generated_tokens += len(c.token_ids)
                    self._note_output(rid)
                    if not hasattr(c, "weight_versions"):  # vLLM 0.26: see _set_label
                        seen = seen or VersionTrack()
                        seen.add(self.version, len(c.token_ids))
                    if c.finish_reason is not None:
                        finish, spans = c.finish_reason, getattr(c, "weight_versions", None)
            except Exception:
                if not self.dead:
                    raise
                died = True  # the tokens so far are good: the caller continues them elsewhere
            finally:
                self._stopped(rid)
            extend_track(track, spans, len(tokens), self.version, self.policy_version, seen)
            if died and len(tokens) < max_tokens:
                self._interrupted.discard(rid)
                self._handed_off.discard(rid)
                return Completion(prompt_ids, tokens, logprobs, track, "engine_died", start_version, started,
                                  time.time(), resubmits, self.index)
            if rid in self._handed_off:
                self._handed_off.discard(rid)
                if finish != "stop" and len(tokens) < max_tokens:  # not already done by itself
                    return Completion(prompt_ids, tokens, logprobs, track, "handed_off", start_version, started,
                                      time.time(), resubmits, self.index)
            if rid in self._interrupted and len(tokens) < max_tokens:
                self._interrupted.discard(rid)
                resubmits += 1
                continue  # resume from prompt + tokens so far under the new weights
            return Completion(prompt_ids, tokens, logprobs, track, finish, start_version, started, time.time(),
                              resubmits, self.index)

    async def generate_group(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                             seed: Optional[int] = None, ignore_eos: bool = False,
                             priority: int = 0) -> list[Completion]:
        """``n`` samples of one prompt from one request (see ``stream_group``), in sample order."""
        done: dict[int, Completion] = {}
        async with contextlib.aclosing(self.stream_group(prompt_ids, n, max_tokens, temperature, seed,
                                                         ignore_eos, priority)) as samples:
            async for index, comp in samples:
                done[index] = comp
        return [done[i] for i in range(n)]

    async def stream_group(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                           seed: Optional[int] = None, ignore_eos: bool = False, priority: int = 0):
        """``n`` samples of one prompt as one vLLM request (parallel sampling, ``n``): one
        request's overhead instead of ``n``. Yields ``(index, Completion)`` as each sample
        finishes, each what ``generate`` would have returned for it: behaviour log-probs, the
        engine's version spans, ``engine_died`` with its tokens so far. With a seed, sample
        ``i`` samples with ``seed + i`` (vLLM's rule), so the samples still differ.

        Not in interrupt mode: it resubmits every sequence from its own prefix, which a
        parallel-sampling request cannot do (use ``generate`` per sample). Nor can one
        sample of it be handed off (``hand_off`` skips them): vLLM aborts it whole."""
        from vllm.inputs import TokensPrompt

        if self.update_mode == "interrupt":
            raise ValueError("group requests cannot be resumed per sequence (update_mode 'interrupt')")
        rid = f"e{self.index}-{next(_ids)}"
        keys = [f"{rid}/{i}" for i in range(n)]  # one running sequence each in ``active``
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        finished: set[int] = set()
        seen: list[Optional[VersionTrack]] = [None] * n  # vLLM 0.26: see _set_label
        start_version, started = self.version, time.time()

        def completion(i: int, finish: str, spans) -> Completion:
            track = VersionTrack()
            extend_track(track, spans, len(tokens[i]), self.version, self.policy_version, seen[i])
            return Completion(prompt_ids, tokens[i], logprobs[i], track, finish, start_version, started,
                              time.time(), 0, self.index)

        for key in keys:
            self._running(key)
            self._grouped.add(key)
        died = False
        params = self._params(max_tokens, temperature, seed, ignore_eos, n=n)
        try:
            # closed here, not at garbage collection, when our consumer stops early: that aborts it
            async with contextlib.aclosing(self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                                                request_id=rid, lora_request=self.lora_request,
                                                                **priority_kwargs(priority))) as stream:
                async for out in stream:
                    for c in out.outputs:  # several samples' deltas when we fell behind
                        i = c.index
                        if i in finished:
                            continue
                        tokens[i] += c.token_ids
                        logprobs[i] += delta_logprobs(c)
                        self.generated_tokens += len(c.token_ids)
                        self._note_output(keys[i])
                        if not hasattr(c, "weight_versions"):
                            seen[i] = seen[i] or VersionTrack()
                            seen[i].add(self.version, len(c.token_ids))
                        if c.finish_reason is not None:
                            finished.add(i)
                            self._stopped(keys[i])
                            yield i, completion(i, c.finish_reason, getattr(c, "weight_versions", None))
        except Exception:
            if not self.dead:
                raise
            died = True  # the tokens so far are good: the caller continues them elsewhere
        finally:
            for key in keys:
                self._stopped(key)
        for i in range(n):
            if i not in finished:
                unfinished = died and len(tokens[i]) < max_tokens
                yield i, completion(i, "engine_died" if unfinished else "length", None)

    async def hand_off(self, count: int) -> int:
        """Abort up to ``count`` running requests so their callers continue them on
        another engine (see ``continue_on``); the most recently started go first. Samples of
        group requests are not candidates: vLLM would abort their whole group."""
        single = [key for key in self.active if key not in self._grouped]
        victims = single[-count:] if count > 0 else []
        self._handed_off.update(victims)
        if victims:
            await self.engine.abort(victims)
        return len(victims)
