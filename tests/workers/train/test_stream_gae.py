"""A streamed GAE step (schedule.stream_train with algorithm.advantage gae) is the whole-batch
step: the advantages are whitened over the whole step's tokens, although the step's batch is
known only at its end. The loss is linear in the advantages there (π_prox = π_θ: the ratio is
1, its clip inactive), so the trainer accumulates the gradient of the raw advantages and that
of unit advantages apart and combines them once the batch's mean and std are known.

Weights are compared as in test_stream_precision.py: AdamW's eps of 1 makes the step linear in
the gradient, so a gradient off by a factor shows in the weights by that factor. Measured on
this CPU in fp32: streamed against whole-batch 2e-5 of the step (the policy's; the critic's
1e-7); a step whitening each arriving group over its own tokens instead was off by 0.46 (the
rewards below make the groups' whitening differ from the batch's: one group has no signal)."""
import dataclasses

import pytest
import torch

from workers.spec import SpecError, validate_spec

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]


def _spec(path: str, **algorithm):
    return validate_spec({
        "name": "stream-gae", "model": {"path": path}, "task": {"dataset": "gen:add"},
        "algorithm": {"advantage": "gae", "lr": 1e-2, "warmup_steps": 0, "lam": 0.5, **algorithm},
        "critic": {"lr": 1e-2}, "trainer": {"micro_batch_tokens": 32},  # several micro-batches per part
        "schedule": {"mode": "sync", "stream_train": True},
    })


def _trainer(spec, path):
    from workers.train.trainer import Trainer

    trainer = Trainer(spec, path, threads=1)
    for engine in (trainer.engine, trainer.critic.engine):
        for group in engine.basic_optimizer.param_groups:
            group["eps"] = 1.0  # the step linear in the gradient (module docstring)
    return trainer


def _batch(trainer):
    """Two prompt groups of three: the first all correct (no signal, its raw advantages all
    alike), the second mixed; behaviour log-probs below the policy's so the importance
    weights differ from 1 (and the loss from −mean(A) = 0)."""
    from workers.models.tinymodel import encode
    from workers.train.samples import TrainSample

    rewards = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    batch = [TrainSample(encode(f"{i}+{i}="), [3, 4, 5, 6][: 2 + i % 3], [0.0] * (2 + i % 3), 0.0, reward=r)
             for i, r in enumerate(rewards)]
    prox = trainer.proximal_logprobs(batch)
    return [dataclasses.replace(s, behav_logprobs=[lp - 0.1 * (i + 1) for lp in p])
            for i, (s, p) in enumerate(zip(batch, prox))]


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {**{"policy." + n: p.detach().clone() for n, p in trainer.engine.module.named_parameters()},
            **{"critic." + n: p.detach().clone() for n, p in trainer.critic.engine.module.named_parameters()}}


def _norm(a: dict, b: dict, prefix: str = "") -> float:
    return sum(float(((a[k] - b[k]) ** 2).sum()) for k in a if k.startswith(prefix)) ** 0.5


@pytest.mark.parametrize("algorithm", [{}, {"kl_coef": 0.5}, {"loss": "reinforce"}],
                         ids=["ppo", "ppo+kl_loss", "reinforce"])
def test_a_streamed_gae_step_is_the_whole_batch_step(tiny_model_path, algorithm):
    spec = _spec("builtin:tiny", **algorithm)
    whole = _trainer(spec, tiny_model_path)
    start = _weights(whole)
    batch = _batch(whole)
    want_stats = whole.train_step(batch)
    want = _weights(whole)

    streamed = _trainer(spec, tiny_model_path)
    assert _norm(_weights(streamed), start) == 0.0
    streamed.begin_step()
    streamed.accumulate(batch[:3])  # each prompt group as it arrives
    streamed.accumulate(batch[3:])
    got_stats = streamed.finish_step(len(batch), rescale=True)
    got = _weights(streamed)

    for prefix in ("policy.", "critic."):
        step = _norm(want, start, prefix)
        assert step > 0
        assert _norm(got, want, prefix) / step < 1e-4, prefix
    assert abs(want_stats["loss/policy"]) > 1e-3
    for key in ("loss/policy", "loss/kl", "critic/value_loss", "critic/adv_mean", "critic/adv_std"):
        assert got_stats[key] == pytest.approx(want_stats[key], rel=1e-5, abs=1e-7), key


def test_whitening_a_streamed_step_is_refused_where_it_cannot_be_exact():
    base = {"name": "s", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
            "algorithm": {"advantage": "gae"}, "schedule": {"mode": "sync", "stream_train": True}}
    validate_spec(base)
    for change in ({"trainer": {"zero_stage": 3}}, {"model": {"path": "builtin:tiny", "dtype": "float16"}}):
        with pytest.raises((SpecError, ValueError), match="whiten_advantages"):
            validate_spec({**base, **change})
        validate_spec({**base, **change, "algorithm": {"advantage": "gae", "whiten_advantages": False}})
