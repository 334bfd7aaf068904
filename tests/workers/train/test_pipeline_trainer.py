"""The fused actor-critic pipeline as a GAE run's trainer (workers/train/pipeline_trainer.py)
on the tiny model: the step it takes is DeepSpeed's trainer's, a checkpoint restores it
exactly, the folder it saves loads, a dead stage is an error, and what it cannot do is
refused by name."""
import dataclasses
import os

import pytest
import torch

from workers.models.tinymodel import encode
from workers.spec import SpecError, validate_spec
from workers.train.pipeline_trainer import PipelineTrainer, length_sorted_parts
from workers.train.ranks import TrainerRankError
from workers.train.trainer import Trainer
from workers.train.samples import TrainSample

LR, CRITIC_LR = 1e-3, 3e-3


def _spec(stages: int = 2, schedule: str = "fused", **algorithm):
    return validate_spec({
        "name": "pipeline", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
        "algorithm": {"advantage": "gae", "lr": LR, "warmup_steps": 0, "lam": 0.5, "minibatches": 1, **algorithm},
        "critic": {"lr": CRITIC_LR}, "trainer": {"micro_batch_tokens": 32,
                                            "pipeline": {"stages": stages, "schedule": schedule,
                                                         "micro_batches": 3}},
    })


def _batch(trainer: Trainer) -> list[TrainSample]:
    """Completions of 2-4 tokens whose behaviour log-probs are the policy's own; rewards 0/1."""
    batch = [TrainSample(encode(f"{i}+{i}="), [3, 4, 5, 6][:2 + i % 3], [0.0] * (2 + i % 3), 0.0,
                         reward=float(i % 2)) for i in range(6)]
    return [dataclasses.replace(s, behav_logprobs=lp) for s, lp in zip(batch, trainer.proximal_logprobs(batch))]


def test_micro_batches_are_cut_from_samples_sorted_by_length():
    assert length_sorted_parts([5, 2, 9, 2, 7], 2) == [[1, 3, 0], [4, 2]]
    assert length_sorted_parts([4, 3], 8) == [[1], [0]]  # never more micro-batches than samples
    assert length_sorted_parts([], 3) == []


def test_what_the_pipeline_cannot_do_is_refused_by_name():
    with pytest.raises(SpecError, match="algorithm.advantage 'gae'"):
        validate_spec({"name": "p", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
                       "trainer": {"pipeline": {"stages": 2}}})
    with pytest.raises(SpecError, match="zero_stage"):
        validate_spec({**_spec().to_dict(), "trainer": {"zero_stage": 2, "pipeline": {"stages": 2}}})
    with pytest.raises(SpecError, match="kl_reference 'stage'"):
        _spec(kl_coef=0.1)
    with pytest.raises(SpecError, match="minibatches and ppo_epochs 1"):
        _spec(ppo_epochs=2)
    assert _spec().algorithm.minibatches == 1  # the default with a pipeline: one step per batch


@pytest.mark.engine
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["fused", "sequential"])
def test_a_pipeline_step_moves_both_models_as_deepspeeds_trainer_does(tiny_model_path, schedule):
    reference = Trainer(_spec(stages=1), tiny_model_path, threads=1)
    batch = _batch(reference)
    pipeline = PipelineTrainer(_spec(schedule=schedule), tiny_model_path, threads=2)
    try:
        for _ in range(2):
            want, got = reference.train_step(batch), pipeline.train_step(batch)
            for key in ("loss/policy", "critic/value_loss", "policy/entropy", "critic/adv_mean",
                        "critic/value_mean"):
                # abs 1e-6: loss/policy sums to ~0 (advantages are centred), where float summation
                # order alone, which differs between CPU models, moves it by ~1e-7
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
            assert 0 <= got["pipeline/bubble"] < 1 and got["trainer/micro_batches"] == 3
        assert pipeline.version == 2
        for mine, theirs, tolerance in ((pipeline.state_dict(), reference.state_dict(), LR / 5),
                                        (pipeline.critic_state_dict(), reference.critic_state_dict(), CRITIC_LR / 5)):
            assert set(mine) == set(theirs)
            # the same objective and AdamW; the padding differs, so Adam's sign-like first steps may
            # differ on elements whose gradient is ~0 (a key bias's is exactly 0: noise, signed)
            apart = total = 0
            for name, tensor in theirs.items():
                diff = (mine[name] - tensor).abs()
                assert float(diff.max()) <= tolerance, name
                apart, total = apart + int((diff > 1e-6).sum()), total + diff.numel()
            assert apart < 0.01 * total
        assert any(float((pipeline.state_dict()[n] - t).abs().max()) > 1e-4
                   for n, t in Trainer(_spec(stages=1), tiny_model_path, threads=1).state_dict().items())  # it moved
    finally:
        pipeline.close()


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_a_restored_pipeline_takes_the_same_next_step_and_its_saved_model_loads(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    batch = _batch(Trainer(_spec(stages=1), tiny_model_path, threads=1))
    first = PipelineTrainer(_spec(), tiny_model_path, threads=2)
    try:
        first.train_step(batch)
        first.save_state(str(tmp_path / "state"))
        first.save(str(tmp_path / "model"))
        saved = first.state_dict()
        want = first.train_step(batch)
    finally:
        first.close()
    second = PipelineTrainer(_spec(), tiny_model_path, threads=2)
    try:
        assert second.load_state(str(tmp_path / "state")) == 1
        got = second.train_step(batch)
    finally:
        second.close()
    for key in ("loss/policy", "critic/value_loss", "critic/value_mean", "policy/grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")).state_dict()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    assert os.path.exists(tmp_path / "model" / "tokenizer.json") or any(
        n.startswith("tokenizer") for n in os.listdir(tmp_path / "model"))


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_a_stage_that_dies_is_an_error_naming_it(tiny_model_path):
    batch = _batch(Trainer(_spec(stages=1), tiny_model_path, threads=1))
    pipeline = PipelineTrainer(_spec(), tiny_model_path, threads=2)
    try:
        os.kill(pipeline.pids[1], 9)
        with pytest.raises(TrainerRankError, match="pipeline rank 1 died") as caught:
            pipeline.train_step(batch)
        assert caught.value.rank == 1
    finally:
        pipeline.close()


@pytest.mark.engine
@pytest.mark.timeout(120)
def test_a_stage_that_raises_fails_the_step_at_once_while_its_peer_still_waits_for_it(tiny_model_path):
    from workers.train.pipeline import Hyper, micro_batches
    from workers.train.pipeline_group import PipelineGroup

    trainer = Trainer(_spec(stages=1), tiny_model_path, threads=1)
    batch, _ = trainer.critic_targets(_batch(trainer))
    mbs = micro_batches(batch, rows=3)
    del mbs[1]["returns"]  # the critic's last stage (rank 0) raises on the second micro-batch
    group = PipelineGroup(tiny_model_path, 2, timeout_s=600)  # rank 1 would wait 600 s in gloo
    try:
        with pytest.raises(TrainerRankError, match="pipeline rank 0 failed:(.|\n)*KeyError: 'returns'"):
            group.train(mbs, Hyper(denominator=10.0), "fused")
    finally:
        group.close()
