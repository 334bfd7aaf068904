"""A trainer rank's process: started by a ``TrainerGroup`` (ranks.py, multiprocessing
*spawn*), it builds one ``Trainer`` of the DeepSpeed world and answers the group's
requests (rank_messages.py) until told to stop; global rank 0 also hosts the weight group.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Optional, Union

from pydantic import BaseModel

from workers.io.lifetime import exit_with_parent
from workers.train.rank_messages import (_REQUESTS, AccumulateRequest, BeginStepRequest, DoneReply, ErrorReply,
                                         FinishStepRequest, FormWeightGroupRequest, HostWeightGroupRequest,
                                         LeaveWeightGroupRequest, LoadStateRequest, PrepareWeightsRequest, ReadyReply,
                                         Sample, SaveRequest, SaveStateRequest, SendWeightsRequest, ShutdownRequest,
                                         StateDictRequest, StateReply, StatsReply, TrainRequest, WeightGroupReply,
                                         _RankConfig)

if TYPE_CHECKING:  # torch and DeepSpeed load in a rank only after its environment is set
    from workers.train.trainer import Trainer
    from workers.train.samples import TrainSample

log = logging.getLogger(__name__)


# -- a rank ----------------------------------------------------------------------------------
def _rank_main(config: _RankConfig, conn: Connection) -> None:
    os.environ.update(config.env)  # before torch.distributed / DeepSpeed read it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops its ranks itself
    exit_with_parent(config.parent_pid)  # even while blocked in a collective
    code = 0
    try:
        rank = _Rank(config)
        conn.send(ReadyReply(rank=config.rank, pid=os.getpid(), version=rank.trainer.version).model_dump())
        while True:
            try:
                request = _REQUESTS.validate_python(conn.recv())
            except EOFError:  # the parent closed its end
                break
            if isinstance(request, ShutdownRequest):
                break
            conn.send(rank.handle(request).model_dump())
    except BaseException as exc:  # noqa: BLE001 — reported to the parent, then this rank exits
        log.exception("trainer rank %d failed", config.rank)
        code = 1
        try:
            conn.send(ErrorReply(rank=config.rank, error=f"{type(exc).__name__}: {exc}",
                                 traceback=traceback.format_exc(limit=8)).model_dump())
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: process-group destructors can block on peers that are gone.
    os._exit(code)


class _Rank:
    def __init__(self, config: _RankConfig):
        from workers.train.trainer import Trainer

        self.rank = config.rank
        self.spec = config.spec
        self.trainer: Trainer = Trainer(config.spec, config.model_path, config.threads, config.pad_id)
        self.weights = _RankZeroWeights(self.trainer) if self.rank == 0 else None

    def handle(self, request) -> BaseModel:
        t = self.trainer
        if isinstance(request, TrainRequest):
            return self._train(request)
        if isinstance(request, (HostWeightGroupRequest, FormWeightGroupRequest, SendWeightsRequest,
                                LeaveWeightGroupRequest)):
            if self.weights is None:
                return DoneReply(rank=self.rank, version=t.version)
            return self.weights.handle(request)
        if isinstance(request, PrepareWeightsRequest):
            # a collective under ZeRO-3: every rank takes part, the sender (rank 0) keeps the copy
            state = t.state_dict(keep=self.weights is not None)
            if self.weights is None:
                return DoneReply(rank=self.rank, version=t.version)
            return self.weights.prepare(state, request)
        if isinstance(request, BeginStepRequest):
            t.begin_step()
        elif isinstance(request, AccumulateRequest):
            t.accumulate(self._samples(request.samples), request.denominator, request.last,
                         grad_scale=request.grad_scale, min_micro_batches=request.micro_batches)
        elif isinstance(request, FinishStepRequest):
            t.finish_step(request.sequences, request.rescale, denominator=request.denominator)
            return self._stats([t._acc], t._acc["seconds"], single=True, critic_sums=t.critic_sums)
        elif isinstance(request, StateDictRequest):
            return self._state(request.model, request.path)
        elif isinstance(request, SaveRequest):
            if self.rank == 0:
                t.save(request.path)
            elif self.spec.trainer.zero_stage == 3:
                t.state_dict(keep=False)  # rank 0's save gathers the shards: a collective
        elif isinstance(request, SaveStateRequest):
            t.save_state(request.folder)
        elif isinstance(request, LoadStateRequest):
            t.load_state(request.folder)
        else:
            raise TypeError(f"unexpected request {request.kind!r}")
        return DoneReply(rank=self.rank, version=t.version)

    @staticmethod
    def _samples(samples: list[Sample]) -> list[TrainSample]:
        from workers.train.samples import TrainSample

        return [TrainSample(s.prompt_ids, s.token_ids, s.behav_logprobs, s.advantage, s.prox_logprobs,
                            reward=s.reward, values=s.values, ref_logprobs=s.ref_logprobs, versions=s.versions,
                            loss_mask=s.loss_mask, token_rewards=s.token_rewards)
                for s in samples]

    def _train(self, request: TrainRequest) -> StatsReply:
        """``Trainer.train_step`` on this rank's shares of the planned steps."""
        t, t0 = self.trainer, time.perf_counter()
        algo = self.spec.algorithm
        single = algo.minibatches == 1 and algo.ppo_epochs == 1
        batch = self._samples(request.samples)
        sums = None
        if t.critic is not None:  # each rank's values for its samples; the statistics' sums added up below
            batch, sums = t.critic_targets(batch, min_micro_batches=request.critic_micro_batches,
                                           counted=request.counted)
        if not single:  # every rank runs the same number of forwards (ZeRO-3 gathers in each)
            prox = t.proximal_logprobs([batch[k] for k in request.proximal],
                                       min_micro_batches=request.proximal_micro_batches)
            for k, p in zip(request.proximal, prox):
                batch[k].prox_logprobs = p
        steps = []
        for step in request.steps:
            t.begin_step()
            t.accumulate([batch[i] for i in step.samples], denominator=step.denominator, last=True,
                         grad_scale=request.grad_scale, min_micro_batches=step.micro_batches)
            steps.append(dict(t._optimizer_step()))
        t.version += 1
        return self._stats(steps, time.perf_counter() - t0, single, sums)

    def _stats(self, steps: list[dict], seconds: float, single: bool,
               critic_sums: Optional[dict[str, float]] = None) -> StatsReply:
        """The step's statistics over all ranks, as ``Trainer`` reports them for one process:
        the losses are already shares of the whole step's (divided by its denominator), so
        they and the token counts add up; the time is the slowest rank's."""
        import torch
        import torch.distributed as dist

        from workers.train.algorithms import CRITIC_SUM_KEYS, MismatchSums, critic_stats, mismatch_stats

        keys = ("loss", "kl", "clip", "entropy", "tokens", "padded", "micro", "dropped", "truncated", "value_loss",
                "value_clip")
        device = self.trainer.engine.device
        sums = torch.tensor([[float(st[k]) for k in keys] for st in steps], dtype=torch.float64, device=device)
        mismatch = MismatchSums.zeros()
        for st in steps:
            mismatch = mismatch.add(st["mismatch"])
        mismatch_sums, mismatch_max = mismatch.sums.to(device), mismatch.maxima.to(device)
        slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
        critic = (torch.tensor([critic_sums[k] for k in CRITIC_SUM_KEYS], dtype=torch.float64, device=device)
                  if critic_sums is not None else None)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dist.all_reduce(mismatch_sums, op=dist.ReduceOp.SUM)
            dist.all_reduce(mismatch_max, op=dist.ReduceOp.MAX)
            if critic is not None:
                dist.all_reduce(critic, op=dist.ReduceOp.SUM)
        rows = [dict(zip(keys, row)) for row in sums.tolist()]
        seconds = max(float(slowest.item()), 1e-9)
        tokens = max(sum(r["tokens"] for r in rows), 1)
        stats: dict[str, Union[int, float]] = {
            "loss/policy": sum(r["loss"] for r in rows) / len(rows),
            "loss/kl": sum(r["kl"] for r in rows) / len(rows),
            "policy/clip_frac": sum(r["clip"] for r in rows) / tokens,
            "policy/behav_dropped_frac": sum(r["dropped"] for r in rows) / tokens,
            "policy/entropy": sum(r["entropy"] for r in rows) / tokens,
            **mismatch_stats(MismatchSums(mismatch_sums.cpu(), mismatch_max.cpu()), sum(r["tokens"] for r in rows),
                             sum(r["dropped"] for r in rows), sum(r["truncated"] for r in rows)),
            "trainer/tokens_per_s": sum(r["padded"] for r in rows) / seconds,
            "trainer/micro_batches": int(sum(r["micro"] for r in rows)),
        }
        if not single:
            stats["trainer/optimizer_steps"] = len(rows)
        if critic is not None:
            stats |= critic_stats(dict(zip(CRITIC_SUM_KEYS, critic.tolist())))
            stats["critic/value_loss"] = sum(r["value_loss"] for r in rows) / len(rows)
            stats["critic/value_clip_frac"] = sum(r["value_clip"] for r in rows) / tokens
        stats["trainer/step_s"] = seconds
        # this rank's own split of its step (time_breakdown.py)
        stats |= {f"trainer/{k}": sum(st.get(k, 0.0) for st in steps) for k in ("backward_s", "optimizer_s")}
        return StatsReply(rank=self.rank, version=self.trainer.version, stats=stats)

    def _state(self, model: str = "policy", path: Optional[str] = None) -> StateReply:
        t = self.trainer
        read = t.critic_state_dict if model == "critic" else t.state_dict
        stage = self.spec.critic.zero_stage if model == "critic" else self.spec.trainer.zero_stage
        if self.rank != 0:
            if stage == 3:
                read(keep=False)  # the gather is a collective: every rank takes part, rank 0 keeps the copy
            return StateReply(rank=self.rank)
        from workers.weights.files import write_weight_file
        from workers.weights.sync import serialize_state_dict, tensors_checksum

        state = read()
        if path is not None:  # no copy of the model in a message: the file is the coordinator's to send
            # the engines hash what they load (the resume check); model.lora: the adapter's config rides along
            write_weight_file(state, path, t.weight_metadata() if model == "policy" else None)
            return StateReply(rank=self.rank)
        return StateReply(rank=self.rank, blob=serialize_state_dict(state), checksum=tensors_checksum(state))


class _RankZeroWeights:
    """Global rank 0 as rank 0 of the weight group. A failure of the group is reported,
    not raised: the trainer is fine, the coordinator forms the group again."""

    def __init__(self, trainer: "Trainer"):
        self.trainer = trainer
        self.group = None
        self.forming: Optional[threading.Thread] = None
        self.formed: dict = {}
        self.meta: Optional[dict] = None
        self.sources: list = []

    def _reply(self, **fields) -> WeightGroupReply:
        return WeightGroupReply(rank=0, **fields)

    def handle(self, request) -> WeightGroupReply:
        from workers.weights.weight_group import host_group

        try:
            if isinstance(request, HostWeightGroupRequest):
                self.close()
                device = self.trainer.engine.device if request.backend == "nccl" else None
                join, form = host_group(request.host, request.world, request.backend, request.timeout_s, device)
                self.formed = {}

                def run() -> None:  # blocks until the engines joined; the rank answers meanwhile
                    try:
                        self.formed["group"] = form()
                    except BaseException as exc:  # noqa: BLE001
                        self.formed["error"] = f"{type(exc).__name__}: {exc}"

                self.forming = threading.Thread(target=run, name="weight-group-form", daemon=True)
                self.forming.start()
                return self._reply(port=join["port"], nccl_id=join.get("nccl_id"))
            if isinstance(request, FormWeightGroupRequest):
                if self.forming is not None:
                    self.forming.join()
                if "error" in self.formed or "group" not in self.formed:
                    return self._reply(error=self.formed.get("error", "the weight group was never hosted"))
                self.group = self.formed["group"]
                return self._reply()
            if isinstance(request, SendWeightsRequest):
                if self.group is None or self.meta is None:
                    return self._reply(error="no weight group, or nothing prepared to send")
                group, key = self.group, self.meta["abort_key"]
                try:
                    group.send(self.meta, self.sources, lambda: group.abort_requested(key))
                finally:
                    self.meta, self.sources = None, []
                return self._reply()
            if isinstance(request, LeaveWeightGroupRequest):
                self.close()
                return self._reply()
        except Exception as exc:  # noqa: BLE001 - the group's failure, reported
            log.warning("trainer rank 0: weight group: %s", exc)
            return self._reply(error=f"{type(exc).__name__}: {exc}")
        raise TypeError(f"unexpected request {request.kind!r}")

    def prepare(self, state: dict, request: PrepareWeightsRequest) -> WeightGroupReply:
        from workers.weights.weight_group import describe_state_dict

        self.meta, self.sources = describe_state_dict(state, request.version, request.bucket_bytes)
        return self._reply(meta=self.meta)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
