"""The Trainer (DeepSpeed on gloo, one rank) on the tiny model: the weights that leave it
are full tensors at every ZeRO stage, and the KL reference runs beside the policy."""
import dataclasses
import math

import pytest
import torch

from workers.spec import validate_spec
from workers.models.tinymodel import encode
from workers.train.trainer import Trainer
from workers.train.samples import TrainSample
from workers.weights.sync import tensors_checksum

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]


def _spec(**algorithm_and_trainer):
    trainer = algorithm_and_trainer.pop("trainer", {})
    return validate_spec({
        "name": "trainer", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add?max_digits=2"}, "reward": {"function": "numeric_match"},
        "algorithm": {"lr": 1e-2, "warmup_steps": 0, **algorithm_and_trainer}, "trainer": trainer,
    })


def _batch(model, n=8):
    """Sequences sampled from the model itself, half with a positive advantage."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = encode(f"{i + 3}+{2 * i}=")
        ids = torch.tensor([prompt])
        tokens = []
        with torch.no_grad():
            for _ in range(6):
                logits = model(input_ids=ids).logits[0, -1]
                tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
                tokens.append(tok)
                ids = torch.cat([ids, torch.tensor([[tok]])], 1)
            logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1:-1], -1)
        behav = logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()
        out.append(TrainSample(prompt, tokens, behav, 1.0 if i % 2 else -1.0))
    return out


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_weights_leaving_the_trainer_are_full_trained_tensors_at_zero_stage(stage, tiny_model_path, hf, tmp_path):
    from transformers import AutoModelForCausalLM

    start = hf.state_dict()
    trainer = Trainer(_spec(trainer={"zero_stage": stage}), tiny_model_path, threads=1)
    before = trainer.state_dict()
    assert set(before) == set(start)  # not ZeRO-3's (0,)-shaped placeholders
    assert all(torch.equal(before[k], start[k]) for k in start)

    trainer.train_step(_batch(hf))
    after = trainer.state_dict()
    assert all(after[k].shape == start[k].shape for k in start)
    changed = [k for k in start if not torch.equal(after[k], start[k])]
    assert len(changed) >= len(start) // 2, changed

    trainer.save(str(tmp_path / "model"))  # a folder from_pretrained takes, holding those weights
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    assert tensors_checksum({k: saved[k] for k in after}) == tensors_checksum(after)


def test_the_kl_reference_pulls_the_loss_towards_the_starting_weights(tiny_model_path, hf):
    batch = _batch(hf)
    trainer = Trainer(_spec(kl_coef=0.5, minibatches=1), tiny_model_path, threads=1)
    assert trainer.reference is not None
    assert next(trainer.reference.parameters()).device == trainer.engine.device
    first = trainer.train_step(batch)
    assert first["loss/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any step
    second = trainer.train_step(batch)
    assert second["loss/kl"] > 1e-4  # the policy moved away from the reference


def _trained(tiny_model_path, batch, **algorithm):
    trainer = Trainer(_spec(**algorithm), tiny_model_path, threads=1)
    stats = trainer.train_step(batch)
    return trainer, stats


def test_one_optimiser_step_per_batch_leaves_ppo_unclipped_and_equal_to_its_proximal_policy(tiny_model_path, hf):
    """π_prox = π_θ during the only step: the ratio is 1 and the clip never binds."""
    trainer, stats = _trained(tiny_model_path, _batch(hf), loss="ppo", clip=0.01, minibatches=1)
    assert stats["policy/clip_frac"] == 0.0 and trainer.version == 1 and "trainer/optimizer_steps" not in stats


def test_by_default_ppo_takes_two_steps_per_batch_its_clip_binds_and_it_is_not_reinforce(tiny_model_path, hf):
    batch = _batch(hf)
    assert _spec(loss="ppo").algorithm.minibatches == 2 and _spec(loss="reinforce").algorithm.minibatches == 1
    ppo, stats = _trained(tiny_model_path, batch, loss="ppo")
    assert stats["trainer/optimizer_steps"] == 2 and stats["policy/clip_frac"] > 0
    reinforce, _ = _trained(tiny_model_path, batch, loss="reinforce", minibatches=2)
    a, b = ppo.state_dict(), reinforce.state_dict()
    assert any(not torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_the_first_minibatch_takes_its_proximal_log_probs_from_its_own_forward(tiny_model_path, hf):
    """One epoch: π_prox is computed only for the samples of the steps after the first (4 of
    8), and the step is the one where every sample had it computed beforehand."""
    batch = _batch(hf)
    lean = Trainer(_spec(loss="ppo", clip=0.05, minibatches=2), tiny_model_path, threads=1)
    asked = []
    forward = lean.proximal_logprobs
    lean.proximal_logprobs = lambda samples, **kw: asked.append(len(samples)) or forward(samples, **kw)
    lean.train_step(batch)
    assert asked == [4]
    full = Trainer(_spec(loss="ppo", clip=0.05, minibatches=2), tiny_model_path, threads=1)
    given = [dataclasses.replace(s, prox_logprobs=p) for s, p in zip(batch, full.proximal_logprobs(batch))]
    full.train_step(given)
    a, b = lean.state_dict(), full.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_minibatches_take_several_optimiser_steps_against_a_fixed_proximal_policy(tiny_model_path, hf):
    batch = _batch(hf)
    ppo, stats = _trained(tiny_model_path, batch, loss="ppo", clip=0.01, minibatches=4, ppo_epochs=2)
    assert stats["trainer/optimizer_steps"] == 8 and ppo.version == 1  # one policy version per batch
    assert stats["policy/clip_frac"] > 0.05  # later minibatches see π_θ ≠ π_prox, and the clip binds

    # π_prox is the start of the batch: the samples' own log-probs under the starting weights.
    start = Trainer(_spec(), tiny_model_path, threads=1)
    first = start.proximal_logprobs(batch)
    assert all(torch.allclose(torch.tensor(p), torch.tensor(s.behav_logprobs), atol=1e-4) for p, s in zip(first, batch))

    reinforce, _ = _trained(tiny_model_path, batch, loss="reinforce", minibatches=4, ppo_epochs=2)
    a, b = ppo.state_dict(), reinforce.state_dict()
    assert any(not torch.allclose(a[k], b[k], atol=1e-6) for k in a)  # the objectives differ here


def test_reinforce_trains_through_the_trainer_with_its_importance_weights_capped(tiny_model_path, hf):
    batch = _batch(hf)
    trainer, stats = _trained(tiny_model_path, batch, loss="reinforce", behav_weight_cap=5.0)
    assert stats["policy/clip_frac"] == 0.0  # on-policy samples: weights are 1, never capped
    assert stats["loss/policy"] != 0.0
    capped = [TrainSample(s.prompt_ids, s.token_ids, [lp - 3.0 for lp in s.behav_logprobs], s.advantage) for s in batch]
    _, stats = _trained(tiny_model_path, capped, loss="reinforce", behav_weight_cap=5.0)
    assert stats["policy/clip_frac"] == 1.0  # π/μ = e^3 > 5 on every token


def test_a_stream_trained_spec_refuses_minibatches():
    from workers.spec import SpecError

    with pytest.raises(SpecError, match="minibatches"):
        validate_spec({"name": "x", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
                       "algorithm": {"minibatches": 2}, "schedule": {"mode": "sync", "stream_train": True}})


def test_the_weights_checksum_takes_scalar_buffers_and_tells_values_apart():
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(3), "empty": torch.zeros(0)}
    same = {k: v.clone() for k, v in state.items()}
    assert tensors_checksum(state) == tensors_checksum(same)
    same["step"] = torch.tensor(4)
    assert tensors_checksum(state) != tensors_checksum(same)
    # a transposed view hashes as its values, like the contiguous copy
    assert tensors_checksum({"t": state["w"].t()}) == tensors_checksum({"t": state["w"].t().contiguous()})


def test_the_step_reports_the_trainer_engine_mismatch_by_staleness_and_what_the_correction_dropped(
        tiny_model_path, hf):
    """Half the samples' behaviour log-probs are the model's own (staleness 0: the trainer
    agrees with them to float noise), half are 0.5 lower and two versions old: their ratio
    is e^0.5 ≈ 1.65, outside mis's band [1/1.5, 1.5]."""
    batch = _batch(hf)
    shifted = [dataclasses.replace(s, versions=[2] * len(s.token_ids)) if i % 2 else
               dataclasses.replace(s, behav_logprobs=[lp - 0.5 for lp in s.behav_logprobs],
                                   versions=[0] * len(s.token_ids))
               for i, s in enumerate(batch)]
    trainer = Trainer(_spec(loss="ppo", minibatches=1, correction="mis", correction_cap=1.5), tiny_model_path,
                      threads=1)
    trainer.version = 2
    stats = trainer.train_step(shifted)
    assert stats["mismatch/kl_stale0"] < 1e-6
    assert stats["mismatch/kl_stale2"] == pytest.approx(math.exp(0.5) - 1.5, abs=1e-3)
    assert stats["mismatch/abs_logp_max_stale2"] == pytest.approx(0.5, abs=1e-3)
    assert stats["mismatch/dropped_share"] == 0.5 == stats["policy/behav_dropped_frac"]
    assert stats["mismatch/ratio_p50"] == pytest.approx(1.0) and stats["mismatch/ratio_p99"] == pytest.approx(
        math.exp(0.5), abs=0.01)
