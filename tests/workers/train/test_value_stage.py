"""The critic's forward as an inference stage (critic.forward: stage,
workers/train/value_stage.py): its worker, loaded with the trainer critic's weights, values
samples as the trainer's critic does, before and after a step; a step on the stage's values
is the step with the critic's forward inside the trainer, which then runs no critic forward
of its own; and the values cross to trainer rank processes in their messages."""
import asyncio
import dataclasses
import os
import tempfile

import pytest

from tests.workers.train.test_critic import _on_policy
from workers.spec import SpecError, validate_spec
from workers.train.trainer import Trainer
from workers.train.samples import TrainSample
from workers.train.value_stage import ValueScorer, ValueStage, scorer_config

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]


def _spec(forward: str, **inference):
    return validate_spec({
        "name": "critic-stage", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
        "algorithm": {"advantage": "gae", "lr": 1e-3, "warmup_steps": 0, "lam": 0.5, "minibatches": 1},
        "critic": {"lr": 3e-2, "forward": forward}, "trainer": {"micro_batch_tokens": 32},
        "inference": inference,
    })


def _uneven(trainer: Trainer) -> list[TrainSample]:
    batch = _on_policy(trainer, [1.0, 0.0, 2.0, 0.5, 1.0])
    batch[1] = dataclasses.replace(batch[1], token_ids=batch[1].token_ids[:2], behav_logprobs=batch[1].behav_logprobs[:2])
    return batch  # rows of different lengths: padding in the stage's forward and the trainer's


def _gap(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x, y))


def test_the_stage_values_samples_as_the_trainers_critic_does_before_and_after_a_step(tiny_model_path):
    spec = _spec("trainer")
    trainer = Trainer(spec, tiny_model_path, threads=1)
    scorer = ValueScorer(**scorer_config(spec, tiny_model_path, pad_id=0))
    batch = _uneven(trainer)
    with pytest.raises(RuntimeError, match="no weights from the trainer"):
        scorer.values([(s.prompt_ids, s.token_ids) for s in batch])
    for step in range(2):
        inside = [s.values for s in trainer.critic_targets(batch)[0]]
        stage = _ship(trainer, scorer, step)
        assert _gap(inside, stage.values([(s.prompt_ids, s.token_ids) for s in batch])) < 1e-5
        trainer.train_step(batch)  # the critic moves: the next round compares the stepped copies
    assert max(abs(v) for x in inside for v in x) > 1e-3  # a trained head, not two zero heads


def test_a_micro_batch_over_micro_batch_tokens_is_valued_in_forwards_that_fit(tiny_model_path):
    trainer = Trainer(_spec("trainer"), tiny_model_path, threads=1)
    batch = _uneven(trainer)
    trainer.train_step(batch)  # a trained head: values that differ per token
    items = [(s.prompt_ids, s.token_ids) for s in batch]
    whole = _ship(trainer, ValueScorer(**scorer_config(_spec("stage"), tiny_model_path, pad_id=0)), 1)
    capped = _ship(trainer, ValueScorer(**scorer_config(_spec("stage", micro_batch_tokens=16), tiny_model_path,
                                                        pad_id=0)), 1)
    sizes = []
    forward = capped._forward
    capped._forward = lambda chunk: sizes.append(len(chunk)) or forward(chunk)
    assert _gap(capped.values(items), whole.values(items)) < 1e-5
    assert sum(sizes) == len(items) and len(sizes) > 1


def _ship(trainer: Trainer, scorer: ValueScorer, version: int) -> ValueScorer:
    from workers.weights.sync import serialize_state_dict

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "critic.safetensors")
        with open(path, "wb") as fh:
            fh.write(serialize_state_dict(trainer.critic_state_dict()))
        scorer.load(path, version)
    assert scorer.version == version
    return scorer


def test_a_step_on_the_stages_values_is_the_step_with_the_critic_inside_and_runs_no_critic_forward(
        tiny_model_path, monkeypatch):
    inside = Trainer(_spec("trainer"), tiny_model_path, threads=1)
    outside = Trainer(_spec("stage"), tiny_model_path, threads=1)
    batch = _uneven(inside)
    scorer = ValueScorer(**scorer_config(_spec("stage"), tiny_model_path, pad_id=0))
    for step in range(2):  # the second step's values come from a head the first step trained
        _ship(outside, scorer, step)
        staged = [dataclasses.replace(s, values=v)
                  for s, v in zip(batch, scorer.values([(s.prompt_ids, s.token_ids) for s in batch]))]
        calls = []
        monkeypatch.setattr(outside.critic, "values", lambda *a: calls.append(a))
        a, b = inside.train_step(batch), outside.train_step(staged)
        monkeypatch.undo()
        assert calls == []  # the trainer ran no critic forward of its own
        for key in ("critic/value_loss", "critic/value_mean", "critic/adv_mean", "loss/policy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), key
    one, two = inside.critic_state_dict(), outside.critic_state_dict()
    # Adam moves each weight by about lr·sign(g) = 3e-2 a step; where |g| is near its eps the
    # step depends on the CPU's summation order: measured 1.05e-4 apart on an AMD EPYC, under
    # 1e-5 on an Intel Xeon. A wrong value flips signs of gradients: 6e-2 apart
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-3
    assert b["critic/value_mean"] != 0.0


def test_the_stage_worker_values_samples_that_finish_together_in_micro_batches(tiny_model_path):
    spec = _spec("stage", micro_batch=4, max_wait_ms=200)
    trainer = Trainer(spec, tiny_model_path, threads=1)
    trainer.train_step(_uneven(trainer))  # a non-zero head
    batch = _on_policy(trainer, [1.0] * 10)
    stage = ValueStage(spec, tiny_model_path, pad_id=0)
    stage.start()
    try:
        stage.load(trainer.critic_state_dict(), trainer.version)

        async def all_of_them():
            return await asyncio.gather(*(stage.values(s.prompt_ids, s.token_ids) for s in batch))
        got = asyncio.run(all_of_them())
        stats = stage.stats()
        assert (stats["batches"], stats["samples"], stats["loads"]) == (3, 10, 1)  # 4 + 4 + 2
        folder = stage.folder
    finally:
        stage.close()
    assert stage.proc.poll() is not None
    assert not os.path.exists(folder)  # the weights' folder went with the stage
    assert {version for _, version in got} == {1}
    want = [s.values for s in trainer.critic_targets(batch)[0]]
    assert _gap(want, [values for values, _ in got]) < 1e-5


def test_values_and_reference_log_probs_cross_to_trainer_ranks_and_spare_their_critic_forwards():
    from workers.train.ranks import plan_train

    spec = _spec("stage")
    batch = [TrainSample([1, 2, 3], [4, 5], [-0.5, -0.6], 0.0, reward=1.0, values=[0.25, 0.5],
                         ref_logprobs=[-0.7, -0.8]) for _ in range(4)]
    requests = plan_train(batch, spec, version=0, world=2)
    assert [r.critic_micro_batches for r in requests] == [0, 0]  # every sample valued: no forwards
    sent = [s for r in requests for s in r.samples]
    assert len(sent) == 4 and all(s.values == [0.25, 0.5] and s.ref_logprobs == [-0.7, -0.8] for s in sent)
    unvalued = [dataclasses.replace(s, values=None) for s in batch]
    assert all(r.critic_micro_batches > 0 for r in plan_train(unvalued, spec, version=0, world=2))


def test_a_critic_stage_without_a_critic_is_refused():
    with pytest.raises(SpecError, match="critic.forward 'stage'"):
        validate_spec({"name": "x", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
                       "critic": {"forward": "stage"}})
