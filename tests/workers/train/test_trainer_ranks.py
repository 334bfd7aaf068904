"""The trainer as several DeepSpeed ranks in their own processes (gloo on the CPU): the
same step as one ``Trainer``, across "nodes" too, a dead rank reported by name, and
ZeRO checkpoints that each rank writes and restores.

Why most comparisons use advantages of 1e-9: Adam's first step is lr·g/(|g|+eps), about
lr·sign(g) for the gradients of ordinary advantages, so the weights after a step barely
depend on the gradients' scale (a wrong loss denominator or an average where a sum was
due goes unseen), and elements with |g| near eps (1e-8) flip with the order of float
sums: one ``Trainer`` differs from itself by ~1e-3 between two packings of the same
batch. With |g| ≪ eps the step is linear in g (lr·g/eps, like SGD): ranks and one
process then agree to ~3e-8, while gradients off by a factor 2 (the ranks' average
where their sum is due) move the weights by half the step, 1e-4 and more here.
"""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from workers.train.algorithms import pack_first_fit_decreasing
from workers.io.ports import free_port
from workers.io.checkpoint import IncompleteCheckpoint, missing_trainer_shards, require_trainer_shards
from workers.spec import validate_spec
from workers.models.tinymodel import encode
from workers.train.trainer import Trainer
from workers.train.samples import TrainSample
from workers.train.ranks import TrainerGroup, TrainerRankError, plan_train
from workers.weights.sync import tensors_checksum

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

LINEAR = 1e-9  # advantage scale that keeps Adam's first steps linear in the gradient (see above)


def _raw_spec(**algorithm_and_trainer) -> dict:
    trainer = {"micro_batch_tokens": 24, **algorithm_and_trainer.pop("trainer", {})}
    return {"name": "ranks", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add?max_digits=2"},
            "reward": {"function": "numeric_match"}, "trainer": trainer,
            "algorithm": {"lr": 1e-2, "warmup_steps": 0, **algorithm_and_trainer}}


def _spec(**kw):
    return validate_spec(_raw_spec(**kw))


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


@pytest.fixture(scope="module")
def batch(hf):
    """Sequences sampled from the model, of uneven lengths (2-12 tokens): the ranks' shares
    pack into different numbers of micro-batches, so idle passes run too."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        prompt = encode(f"{i * 7 + 3}+{2 * i}=")
        ids, tokens = torch.tensor([prompt]), []
        with torch.no_grad():
            for _ in range(2 + (i * 5) % 11):
                logits = hf(input_ids=ids).logits[0, -1]
                tokens.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
                ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], 1)
            logp = torch.log_softmax(hf(input_ids=ids).logits[0, len(prompt) - 1 : -1], -1)
        behav = logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()
        out.append(TrainSample(prompt, tokens, behav, 1.0 if i % 2 else -1.0))
    return out


def _scaled(batch, scale):
    return [dataclasses.replace(s, advantage=s.advantage * scale) for s in batch]


def _length(s) -> int:
    return len(s.prompt_ids) + len(s.token_ids)


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _without_timings(stats: dict) -> dict:
    """A step's statistics without the wall times each rank measures for itself."""
    return {k: v for k, v in stats.items() if not k.endswith("_s")}


def _assert_same_stats(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key in ("loss/policy", "loss/kl", "policy/clip_frac", "policy/entropy", "mismatch/kl",
                "mismatch/ratio_p50", "mismatch/dropped_share"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    # a max over tokens of float32 differences: at float noise both ways (a few 1e-6), whatever
    # the reduction order of the two layouts
    assert got["mismatch/abs_logp_max"] == pytest.approx(want["mismatch/abs_logp_max"], abs=2e-5)
    assert got.get("trainer/optimizer_steps") == want.get("trainer/optimizer_steps")


def _survivors(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (not reaped), and any process whose parent is one of them."""
    alive = []
    for proc in psutil.process_iter(["pid", "ppid", "status"]):
        info = proc.info
        if info["status"] == psutil.STATUS_ZOMBIE and info["pid"] not in pids:
            continue
        if info["pid"] in pids or info["ppid"] in pids:
            alive.append(info["pid"])
    return alive


def test_the_plan_covers_each_step_once_with_the_whole_steps_denominator(batch):
    spec = _spec(minibatches=2, ppo_epochs=2)
    plan = plan_train(batch, spec, version=3, world=2)
    assert len(plan) == 2 and all(len(r.steps) == 4 and r.grad_scale == 2.0 for r in plan)
    for k in range(4):
        trained = [tuple(r.samples[i].token_ids) for r in plan for i in r.steps[k].samples]
        assert len(trained) == len(set(trained)) == 4  # the minibatch, split between the ranks
        assert plan[0].steps[k].denominator == plan[1].steps[k].denominator == sum(len(t) for t in trained)
    single = plan_train(batch, _spec(minibatches=1), version=0, world=2)
    shares = [[_length(r.samples[i]) for i in r.steps[0].samples] for r in single]
    assert sorted(sum(shares, [])) == sorted(_length(s) for s in batch)
    assert abs(sum(shares[0]) - sum(shares[1])) <= max(max(s) for s in shares)  # balanced by tokens
    assert single[0].proximal_micro_batches == 0 and single[0].steps[0].micro_batches >= 2
    # With two minibatches of this batch, a rank packs fewer micro-batches than its peer in
    # some step: it runs idle passes (test_two_ranks_take_the_same_step_as_one_process).
    two = plan_train(batch, _spec(minibatches=2), version=0, world=2)
    packed = [[len(pack_first_fit_decreasing([_length(r.samples[i]) for i in st.samples], 24)) for st in r.steps]
              for r in two]
    assert any(packed[r][k] < two[r].steps[k].micro_batches for r in range(2) for k in range(2))


def test_with_several_epochs_each_sample_counts_once_in_the_batchs_statistics(batch):
    """gae over ranks: with ppo_epochs 2 a sample trains on both ranks (a different split each
    epoch), but the whitening's moments and critic/* add up over the ranks, so each sample is
    counted on one rank only."""
    plan = plan_train(batch, _spec(advantage="gae", minibatches=2, ppo_epochs=2), version=1, world=2)
    held = [{tuple(s.token_ids) for s in r.samples} for r in plan]
    assert held[0] & held[1]  # overlapping: counting every sample a rank holds would count these twice
    counted = [tuple(r.samples[k].token_ids) for r in plan for k in r.counted]
    assert sorted(counted) == sorted(tuple(s.token_ids) for s in batch)
    single = plan_train(batch, _spec(advantage="gae", minibatches=1), version=1, world=2)
    assert all(r.counted == list(range(len(r.samples))) for r in single)  # disjoint shares: all counted


# The default run takes each stage and each minibatch count once, ZeRO-3 with minibatches (the
# harder pair) among them; the nightly set (slow) the other two pairs.
@pytest.mark.parametrize("stage,minibatches", [(2, 1), pytest.param(3, 1, marks=pytest.mark.slow),
                                               pytest.param(2, 2, marks=pytest.mark.slow), (3, 2)])
def test_two_ranks_take_the_same_step_as_one_process(stage, minibatches, tiny_model_path, batch, tmp_path):
    spec = _spec(minibatches=minibatches, trainer={"zero_stage": stage})
    linear, ordinary = _scaled(batch, LINEAR), batch
    with TrainerGroup(spec, tiny_model_path, 2, 1, 0) as group:
        assert group.version == 0
        stats = [group.train_step(linear)]
        after_linear = group.state_dict()
        stats.append(group.train_step(ordinary))
        after_ordinary = group.state_dict()
        assert group.version == 2
        group.save(str(tmp_path / "model"))  # rank 0 writes; under ZeRO-3 every rank gathers with it
    saved = load_file(tmp_path / "model" / "model.safetensors")
    assert tensors_checksum(saved) == tensors_checksum({k: after_ordinary[k] for k in saved})
    assert (tmp_path / "model" / "config.json").exists()
    one = Trainer(spec, tiny_model_path, threads=1)
    start = one.state_dict()
    start = {k: v.clone() for k, v in start.items()}
    _assert_same_stats(stats[0], one.train_step(linear))
    want = one.state_dict()
    assert _max_diff(want, start) > 2e-4  # the step moved the weights by far more than the tolerance
    assert _max_diff(after_linear, want) < 1e-6  # measured: <= 3e-8
    _assert_same_stats(stats[1], one.train_step(ordinary))
    # Sign-like Adam steps: elements with |g| ~ eps differ (one process vs itself: ~1e-3);
    # a rank's share lost or counted twice would flip whole tensors (2·lr = 2e-2).
    assert _max_diff(after_ordinary, one.state_dict()) < 5e-3


CRITIC_KEYS = ("critic/value_loss", "critic/value_mean", "critic/return_mean", "critic/adv_mean", "critic/adv_std",
               "critic/explained_var", "loss/policy")


# ZeRO-3 and several epochs each in the default run; the plain pair in the nightly set (slow)
@pytest.mark.parametrize("stage,epochs", [pytest.param(2, 1, marks=pytest.mark.slow), (3, 1), (2, 2)])
def test_two_ranks_train_policy_and_critic_as_one_process_does(stage, epochs, tiny_model_path, batch):
    """algorithm.advantage gae over two ranks, the critic at the same ZeRO stage: each rank's
    critic values its samples, the statistics add up over ranks, and the critic's gradients
    are scaled like the policy's. Rewards of 1e-9 keep both Adam steps linear in the
    gradient (see the module docstring): the second step's values show the first update."""
    # whitening off: whitened advantages are O(1) and Adam's steps sign-like, not linear
    # (whitening over ranks: tests/workers/train/test_advantage_whitening.py)
    # epochs 2: two minibatches of two epochs, each sample on both ranks (counted on one)
    raw = _raw_spec(advantage="gae", whiten_advantages=False, trainer={"zero_stage": stage},
                    **({"minibatches": 2, "ppo_epochs": epochs} if epochs > 1 else {}))
    # critic lr 1e-8: its linear step moves the values by ~1e-8, the returns' scale, so the
    # second step's advantages stay tiny and the policy's step linear too
    spec = validate_spec({**raw, "critic": {"zero_stage": stage, "lr": 1e-8}})
    tiny = [dataclasses.replace(s, reward=LINEAR * (1.0 + i % 3)) for i, s in enumerate(batch)]
    with TrainerGroup(spec, tiny_model_path, 2, 1, 0) as group:
        stats = [group.train_step(tiny)]
        after_first = group.state_dict()
        stats.append(group.train_step(tiny))
        after = group.state_dict()
    one = Trainer(spec, tiny_model_path, threads=1)
    start = {k: v.clone() for k, v in one.state_dict().items()}
    want = [one.train_step(tiny)]
    moved = _max_diff(one.state_dict(), start)
    # the step moves weights by ~1e-3; the ranks' sum differs from one process's by 3e-8 to
    # 2.7e-6 (measured: the order of summation, which varies by CPU and run), where a rank's
    # share lost or counted twice would be off by a good part of the step itself
    assert moved > 1e-4 and _max_diff(after_first, one.state_dict()) < 1e-5
    want.append(one.train_step(tiny))
    assert want[0]["critic/value_mean"] == 0.0 and abs(want[1]["critic/value_mean"]) > 0  # the critic moved
    for got, expected in zip(stats, want):
        for key in CRITIC_KEYS:
            assert got[key] == pytest.approx(expected[key], rel=1e-3, abs=0), key
    assert _max_diff(after, one.state_dict()) < 1e-5


def test_a_streamed_step_over_two_ranks_equals_one_process_on_the_whole_batch(tiny_model_path, batch):
    """begin_step / accumulate as groups arrive / finish_step(rescale): the controller's
    stream training, the denominator known only at the end (ZeRO-1 here)."""
    spec = _spec(minibatches=1, trainer={"zero_stage": 1})  # streamed: one optimiser step
    linear = _scaled(batch, LINEAR)
    with TrainerGroup(spec, tiny_model_path, 2, 1, 0) as group:
        group.begin_step()
        group.accumulate(linear[:3])
        group.accumulate(linear[3:])
        stats = group.finish_step(len(linear), True)
        weights = group.state_dict()
        assert group.version == 1
    one = Trainer(spec, tiny_model_path, threads=1)
    _assert_same_stats(stats, one.train_step(linear))
    assert _max_diff(weights, one.state_dict()) < 1e-6


@pytest.mark.parametrize("stage", [2, 3])
def test_a_streamed_step_equals_the_step_on_the_whole_batch_at_zero_stage(tiny_model_path, batch, stage):
    """Stream training beyond ZeRO-1: DeepSpeed partitions gradients as they are made, so the
    streamed step ends with a boundary pass and the denominator as the optimizer's loss scale."""
    spec = _spec(minibatches=1, trainer={"zero_stage": stage})
    linear = _scaled(batch, LINEAR)
    streamed = Trainer(spec, tiny_model_path, threads=1)
    streamed.begin_step()
    streamed.accumulate(linear[:3])
    streamed.accumulate(linear[3:])
    stats = streamed.finish_step(len(linear), True)
    assert streamed.engine.optimizer.loss_scale == 1.0  # set back: the next backward is not scaled
    weights = streamed.state_dict()
    whole = Trainer(spec, tiny_model_path, threads=1)
    _assert_same_stats(stats, whole.train_step(linear))
    assert _max_diff(weights, whole.state_dict()) < 1e-6
    # and the next step, a whole batch again, still agrees
    assert _max_diff(streamed.train_step(linear) and streamed.state_dict(),
                     whole.train_step(linear) and whole.state_dict()) < 1e-6


_NODE = r"""
import json, logging, sys
import torch
from workers.spec import validate_spec
from workers.train.samples import TrainSample
from workers.train.ranks import TrainerGroup

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    args = json.loads(open(sys.argv[1]).read())
    batch = [TrainSample(**s) for s in args["batch"]]
    with TrainerGroup(validate_spec(args["spec"]), args["model"], 1, 1, 0, master_port=args["port"], nnodes=2,
                      node_rank=1) as group:
        stats = group.train_step(batch)
        assert group.state_dict() is None  # the weights come back on node 0 only
    print("STATS " + json.dumps(stats))
"""


def test_two_nodes_on_loopback_form_one_world(tiny_model_path, batch, tmp_path):
    raw = _raw_spec(trainer={"zero_stage": 2})
    linear = _scaled(batch, LINEAR)
    port = free_port("127.0.0.1")
    args = tmp_path / "node1.json"
    args.write_text(json.dumps({"spec": raw, "model": tiny_model_path, "port": port,
                                "batch": [dataclasses.asdict(s) for s in linear]}))
    root = Path(__file__).resolve().parents[3]
    node1 = subprocess.Popen([sys.executable, "-c", _NODE, str(args)], cwd=root, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        with TrainerGroup(validate_spec(raw), tiny_model_path, 1, 1, 0, master_port=port, nnodes=2,
                          node_rank=0) as group:
            assert group.world == 2 and group.first_rank == 0
            stats = group.train_step(linear)
            weights = group.state_dict()
        out, err = node1.communicate(timeout=120)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert node1.returncode == 0, err[-3000:]
    remote = json.loads(next(line for line in out.splitlines() if line.startswith("STATS "))[6:])
    # every rank reduces the same statistics (its own wall times, trainer/*_s, aside)
    assert _without_timings(remote) == _without_timings(stats)

    one = Trainer(validate_spec(raw), tiny_model_path, threads=1)
    _assert_same_stats(stats, one.train_step(linear))
    assert _max_diff(weights, one.state_dict()) < 1e-6


@pytest.mark.parametrize("when", ["between calls", "during a call"])
def test_a_killed_rank_fails_the_next_call_by_name_and_leaves_no_process(when, tiny_model_path, batch):
    group = TrainerGroup(_spec(trainer={"zero_stage": 2}), tiny_model_path, 2, 1, 0)
    pids = group.pids
    try:
        group.train_step(batch)
        victim = pids[1]
        if when == "between calls":
            os.kill(victim, signal.SIGKILL)
        else:  # rank 0 then waits for it inside the step's collectives
            os.kill(victim, signal.SIGSTOP)
            threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(TrainerRankError, match=rf"trainer rank 1 \(pid {victim}\) was killed by SIGKILL") as err:
            group.train_step(batch)
        assert time.monotonic() - t0 < 10
        assert err.value.rank == 1 and err.value.exitcode == -signal.SIGKILL
        with pytest.raises(TrainerRankError, match="rank 1"):  # and every later call
            group.state_dict()
    finally:
        group.close()
        group.close()  # idempotent
    assert _survivors(pids) == []


def test_a_rank_that_raises_fails_the_call_with_its_error(tiny_model_path, batch, tmp_path):
    with TrainerGroup(_spec(), tiny_model_path, 2, 1, 0) as group:
        pids = group.pids
        with pytest.raises(TrainerRankError, match=r"(?s)trainer rank \d \(pid \d+\) exited with code 1: "
                                                   r"AssertionError.*in load_state"):
            group.load_state(str(tmp_path / "nothing"))
    assert _survivors(pids) == []


def test_each_rank_saves_and_restores_its_zero_shard(tiny_model_path, batch, tmp_path):
    spec = _spec(trainer={"zero_stage": 2})
    second = [dataclasses.replace(s, advantage=-s.advantage) for s in batch]
    with TrainerGroup(spec, tiny_model_path, 2, 1, 0) as group:
        group.train_step(batch)
        group.save_state(str(tmp_path / "trainer"))
        group.train_step(second)
        uninterrupted = group.state_dict()
    shards = sorted(p.name for p in (tmp_path / "trainer" / "ds").glob("*optim_states.pt"))
    assert len(shards) == 2 and "rank_0" in shards[0] and "rank_1" in shards[1]
    # The names the coordinator checks before publishing a checkpoint (and before resuming)
    # are the ones DeepSpeed wrote; without rank 1's (a node without shared storage) it is refused.
    assert missing_trainer_shards(tmp_path / "trainer", 2, 2) == []
    (tmp_path / "trainer" / "ds" / shards[1]).rename(tmp_path / shards[1])
    with pytest.raises(IncompleteCheckpoint, match=f"lacks 1 of the 2 trainer ranks' DeepSpeed files \\({shards[1]}\\)"):
        require_trainer_shards(tmp_path / "trainer", 2, 2)
    (tmp_path / shards[1]).rename(tmp_path / "trainer" / "ds" / shards[1])

    with TrainerGroup(spec, tiny_model_path, 2, 1, 0) as group:
        assert group.load_state(str(tmp_path / "trainer")) == 1 and group.version == 1
        group.train_step(second)
        restored = group.state_dict()
        assert group.version == 2
    assert _max_diff(restored, uninterrupted) == 0.0
