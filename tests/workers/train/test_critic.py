"""The critic of algorithm.advantage gae (workers/train/critic.py) inside a real DeepSpeed
trainer on the tiny model: where its weights start, the advantages it hands the policy
loss, that it learns the returns, and a checkpoint that restores it exactly."""
import dataclasses

import pytest
import torch

from workers.models.tinymodel import encode
from workers.spec import SpecError, validate_spec
from workers.train.algorithms import critic_stats
from workers.train.trainer import Trainer
from workers.train.samples import TrainSample

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]


def _spec(**algorithm):
    return validate_spec({
        "name": "critic", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
        "algorithm": {"advantage": "gae", "lr": 1e-3, "warmup_steps": 0, "lam": 0.5, **algorithm},
        "critic": {"lr": 3e-3}, "trainer": {"micro_batch_tokens": 32},
    })


def _on_policy(trainer: Trainer, rewards: list[float]) -> list[TrainSample]:
    """Four-token completions whose behaviour log-probs are the trainer's own (importance weights 1);
    the reward depends on the prompt only, so a critic can learn it."""
    batch = [TrainSample(encode(f"{i}+{i}="), [3, 4, 5, 6], [0.0] * 4, 0.0, reward=r) for i, r in enumerate(rewards)]
    return [dataclasses.replace(s, behav_logprobs=lp) for s, lp in zip(batch, trainer.proximal_logprobs(batch))]


def test_the_critic_starts_from_the_policys_trunk_with_a_zero_value_head(tiny_model_path):
    # the raw GAE advantages (whitened ones: tests/workers/train/test_advantage_whitening.py)
    trainer = Trainer(_spec(whiten_advantages=False), tiny_model_path, threads=1)
    policy = trainer.engine.module.state_dict()
    critic = trainer.critic.engine.module.state_dict()
    trunk = {k.removeprefix("trunk."): v for k, v in critic.items() if k.startswith("trunk.")}
    assert trunk and all(torch.equal(v, policy["model." + k]) for k, v in trunk.items())
    assert not critic["value_head.weight"].any() and not critic["value_head.bias"].any()
    # values 0, so with γ 1 and λ 0.5 the advantage of token t of 4 is 0.5^(3-t) · reward
    targets, sums = trainer.critic_targets(_on_policy(trainer, [1.0, 0.0, 2.0]))
    stats = critic_stats(sums)
    assert [s.token_advantages for s in targets] == [[0.125, 0.25, 0.5, 1.0], [0.0] * 4, [0.25, 0.5, 1.0, 2.0]]
    assert targets[0].returns == targets[0].token_advantages and targets[0].values == [0.0] * 4
    assert stats["critic/explained_var"] == 0.0 and stats["critic/value_mean"] == 0.0


def test_the_policy_loss_takes_the_critics_per_token_advantages(tiny_model_path):
    trainer = Trainer(_spec(minibatches=1, whiten_advantages=False), tiny_model_path, threads=1)
    stats = trainer.train_step(_on_policy(trainer, [1.0, 0.0, 2.0]))
    # on-policy, one step: ratio 1 and weight 1, so the loss is minus the tokens' mean advantage
    assert stats["loss/policy"] == pytest.approx(-(1.875 + 0.0 + 3.75) / 12, rel=1e-5)
    assert stats["policy/behav_dropped_frac"] == 0.0
    # its value loss: ½·mean((0 − return)²) over the 12 tokens, the head still at 0
    returns = [0.125, 0.25, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0, 0.25, 0.5, 1.0, 2.0]
    assert stats["critic/value_loss"] == pytest.approx(0.5 * sum(r * r for r in returns) / 12, rel=1e-5)


def test_the_critic_learns_the_returns_of_a_batch(tiny_model_path):
    trainer = Trainer(_spec(lr=1e-9), tiny_model_path, threads=1)  # the policy barely moves: a fixed target
    batch = _on_policy(trainer, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    history = [trainer.train_step(batch) for _ in range(12)]
    losses = [h["critic/value_loss"] for h in history]
    assert losses[-1] < 0.5 * losses[0]
    assert history[-1]["critic/explained_var"] > 0.3 > history[0]["critic/explained_var"]


def test_a_restored_critic_takes_the_same_next_step(tiny_model_path, tmp_path):
    first = Trainer(_spec(), tiny_model_path, threads=1)
    batch = _on_policy(first, [1.0, 0.0, 1.0])
    first.train_step(batch)
    first.save_state(str(tmp_path))
    want = first.train_step(batch)
    second = Trainer(_spec(), tiny_model_path, threads=1)
    assert second.load_state(str(tmp_path)) == 1
    got = second.train_step(batch)
    for key in ("critic/value_loss", "critic/value_mean", "critic/explained_var", "loss/policy"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    assert (tmp_path / "critic").is_dir() and (tmp_path / "ds").is_dir()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_streamed_gae_step_equals_the_step_on_the_whole_batch(tiny_model_path, stage):
    """schedule.stream_train: the critic values each group as it arrives (weights from the
    step's start), losses are sums until finish_step divides both engines' gradients (at
    ZeRO-2 through the optimizers' loss scale)."""
    # rewards of 1e-9 and a critic lr of 1e-8 keep Adam's steps linear in the gradients (a wrong
    # denominator then shows in the weights: tests/workers/train/test_trainer_ranks.py's docstring)
    # whitening off: ZeRO-2 refuses it in a streamed step (whitened: tests/workers/train/test_stream_gae.py)
    spec = validate_spec({**_spec(minibatches=1, whiten_advantages=False).to_dict(),
                          "schedule": {"mode": "sync", "stream_train": True},
                          "critic": {"lr": 1e-8, "zero_stage": stage}, "trainer": {"zero_stage": stage}})
    whole = Trainer(spec, tiny_model_path, threads=1)
    batch = _on_policy(whole, [1e-9, 0.0, 2e-9, 1e-9, 0.0])
    want = whole.train_step(batch)
    streamed = Trainer(spec, tiny_model_path, threads=1)
    streamed.begin_step()
    streamed.accumulate(batch[:2])
    streamed.accumulate(batch[2:])
    got = streamed.finish_step(len(batch), rescale=True)
    for key in ("critic/value_loss", "critic/explained_var", "critic/adv_mean", "critic/adv_std", "loss/policy"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=0), key
    for name, engine in (("policy", "engine"), ("critic", None)):
        a = (whole.engine if engine else whole.critic.engine).module.state_dict()
        b = (streamed.engine if engine else streamed.critic.engine).module.state_dict()
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6, name
    # the next values show the critic's update: the same in both
    assert whole.train_step(batch)["critic/value_mean"] == pytest.approx(
        streamed.train_step(batch)["critic/value_mean"], rel=1e-5)


def test_a_critic_across_nodes_is_refused_by_name():
    with pytest.raises(SpecError, match="gae' runs on one node for now"):
        validate_spec({"name": "x", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
                       "algorithm": {"advantage": "gae"}, "resources": {"nodes": 2, "trainer_ranks": 2}})
