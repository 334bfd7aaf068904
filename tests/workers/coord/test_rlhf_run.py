"""An async RLHF run on the real engine with RLHF's four models: the actor, a critic
(algorithm.advantage gae), a neural reward model in its own worker (reward.model) and the
KL reference, with RLHFuse's inference stage whole: the reward model, the reference
(algorithm.kl_reference: stage) and the critic's forward (critic.forward: stage) take every
sample in shared micro-batches as it finishes (a rule rides along at weight 0). The critic
trains beside the policy at every step and its stage copy is reloaded after each, their
metrics are reported, the critic's DeepSpeed state is in the checkpoint (restored exactly:
tests/workers/train/test_critic.py) and every stage worker is gone at the end."""
import asyncio
import json

import pytest

from workers.coord.controller import Controller
from workers.io.checkpoint import latest_checkpoint
from workers.spec import validate_spec


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_an_async_rlhf_run_scores_with_the_reward_model_and_trains_and_checkpoints_its_critic(tmp_path):
    spec = validate_spec({
        "name": "rlhf", "model": {"path": "builtin:tiny"},
        "task": {"dataset": "gen:add?max_digits=2", "size": 200, "eval_size": 10},
        "reward": {"components": [{"function": "model"}, {"function": "numeric_match", "weight": 0}],
                   "model": {"path": "builtin:tiny-rm", "max_wait_ms": 200}},
        "algorithm": {"advantage": "gae", "lr": 3e-4, "group_size": 2, "warmup_steps": 0, "kl_coef": 0.01,
                      "kl_reference": "stage"},
        "critic": {"forward": "stage"},
        "inference": {"max_wait_ms": 200},
        "rollout": {"max_tokens": 8},
        # longest_first: the async look-ahead window with aging (workers/coord/scheduling.py) runs here too
        "schedule": {"mode": "async", "max_staleness": 1, "batch_prompts": 4, "dispatch": "longest_first"},
        "trainer": {"checkpoint_every": 2},
        "stop": {"max_steps": 4, "max_minutes": 5},
        "eval": {"every_steps": 0, "prompts": 10},
    })
    out = tmp_path / "out"
    controller = Controller(spec, out, progress=False)
    result = asyncio.run(controller.run())
    assert result.steps == 4
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_key = {}
    for m in metrics:
        by_key.setdefault(m["key"], []).append(m["value"])
    for key in ("critic/value_loss", "critic/explained_var", "critic/value_mean", "critic/adv_mean",
                "critic/adv_std", "critic/return_mean"):
        assert len(by_key.get(key, [])) == 4, key
    assert by_key["critic/value_mean"][0] == 0.0  # the value head starts at 0
    assert by_key["critic/value_mean"][-1] != 0.0  # and was trained
    assert by_key["critic/value_loss"][0] > 0
    # the reward model scored every trained sample (and the look-ahead's), sharing forwards
    assert by_key["reward_model/texts"][-1] >= result.trained_samples == 4 * 4 * 2
    assert by_key["reward_model/mean_batch"][-1] > 1.5
    model_part, rule_part = by_key["reward/part/model"], by_key["reward/part/numeric_match"]
    assert by_key["reward/mean"] == pytest.approx(model_part)  # the rule at weight 0 is reported, not trained on
    assert all(0 < v < 1 for v in model_part) and all(0 <= v <= 1 for v in rule_part)
    assert by_key["reference_stage/samples"][-1] >= result.trained_samples
    # the held-out evaluation before training was scored by the reward model, not sent to the reference
    assert by_key["reward_model/texts"][-1] - by_key["reference_stage/samples"][-1] == 10
    assert by_key["reference_stage/mean_batch"][-1] > 1.5
    assert len(by_key["loss/kl"]) == 4 and by_key["loss/kl"][-1] > 0  # the policy moved off the reference
    assert controller.processes.trainer.reference is None  # the trainer held no reference
    # every process's peak memory, the inference stage's workers by the names the plan gives them
    assert all(result.memory_peak_gib[name] > 0.05 for name in ("reward model", "KL reference stage", "critic stage"))
    assert {"reward model", "KL reference stage", "critic stage"} <= set(result.memory_plan_gib)  # and planned
    assert controller.fleet.rewards.model.proc.poll() is not None  # the stage workers ended with the run
    assert controller.processes.reference.proc.poll() is not None
    # the critic's forward: in the stage for every trained sample, none of them held-out ones
    assert by_key["critic_stage/samples"][-1] >= result.trained_samples
    assert by_key["critic_stage/samples"][-1] == by_key["reference_stage/samples"][-1]
    assert by_key["critic_stage/mean_batch"][-1] > 1.5
    assert by_key["critic_stage/loads"] == [2, 3, 4, 5]  # the start, then after every step
    # async: a sample was valued by the critic of the step it finished in, at most max_staleness behind
    assert all(0 <= lag <= 1 for lag in by_key["critic_stage/lag"])
    assert controller.processes.critic_stage.proc.poll() is not None
    checkpoint = latest_checkpoint(out)
    assert checkpoint.step == 4
    assert any((checkpoint.path / "trainer" / "critic").iterdir())
