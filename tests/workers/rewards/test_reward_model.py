"""A neural reward model as a scoring stage (workers/rewards/model.py): its own worker
process, fed in micro-batches, scoring what the same model scores in-process; a worker
that dies, stalls or cannot load is a named error; the shipped tiny reward model tells
right from wrong answers as its manifest says."""
import asyncio
import json
import os
import signal

import pytest

from workers.models.preflight import ModelCheckError
from workers.models.reward_model import (BUILTIN, MANIFEST, accuracy, ensure_tiny_reward_model,
                                         resolve_reward_model_path, training_texts)
from workers.rewards.model import RewardModelClient, RewardModelError, Scorer
from workers.rewards.service import RewardFunctionBroken, RewardService
from workers.spec import RewardModelSpec, RewardSpec, SpecError, validate_spec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def rm_path():
    return str(ensure_tiny_reward_model(progress=False))


@pytest.fixture
def client(rm_path):
    c = RewardModelClient(RewardModelSpec(path=rm_path, micro_batch=16, max_wait_ms=200))
    c.start()
    yield c
    c.close()


def _score_all(client, texts):
    async def go():
        return await asyncio.gather(*(client.score(t) for t in texts))
    return asyncio.run(go())


def test_texts_that_finish_together_share_micro_batches_and_score_what_the_model_scores_in_process(client, rm_path):
    texts = [f"{a}+{b}={a + b + (a % 3 == 0)}" for a, b in zip(range(40), range(7, 47))]
    scores = _score_all(client, texts)
    stats = client.stats()
    assert (stats["batches"], stats["texts"], stats["mean_batch"]) == (3, 40, 40 / 3)  # 16 + 16 + 8, not 40 forwards
    direct = Scorer(rm_path).logits(texts)
    assert max(abs(s - client.reward(d)) for s, d in zip(scores, direct)) < 1e-6
    assert all(0.0 < s < 1.0 for s in scores)  # output: probability


def test_texts_over_micro_batch_tokens_are_scored_in_forwards_that_fit_with_the_same_logits(rm_path):
    texts = [f"{a}+{b}={a + b}" + " ok" * (a % 4) for a, b in zip(range(12), range(30, 42))]
    capped = Scorer(rm_path, max_tokens=24)
    sizes = []
    forward = capped._forward
    capped._forward = lambda seqs: sizes.append(len(seqs) * max(map(len, seqs))) or forward(seqs)
    got, want = capped.logits(texts), Scorer(rm_path).logits(texts)
    assert len(sizes) > 1 and all(size <= 24 for size in sizes)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5


def test_the_shipped_reward_model_tells_right_from_wrong_as_its_manifest_states(rm_path):
    from transformers import AutoModelForCausalLM

    from workers.models.tinymodel import ensure_tiny_model

    manifest = json.loads(open(os.path.join(rm_path, MANIFEST)).read())
    scorer = Scorer(rm_path)
    policy = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(progress=False)).eval()
    recipe = manifest["recipe"]
    held_out = training_texts(policy, scorer.tokenizer, recipe, recipe["held_out"], seed=recipe["seed"] + 99)
    measured = accuracy(scorer.model, scorer.tokenizer, held_out, scorer.pad_id)
    assert abs(measured - manifest["held_out_accuracy"]) < 0.01, (measured, manifest["held_out_accuracy"])
    assert measured > manifest["held_out_accuracy_before"] + 0.2  # it learned: the untrained head is near chance
    right = [t for t, y in held_out if y == 1.0][:50]
    wrong = [t for t, y in held_out if y == 0.0][:50]
    logits = scorer.logits(right + wrong)
    assert sum(logits[:50]) / 50 > sum(logits[50:]) / 50 + 1.0


def test_a_worker_that_dies_or_stalls_is_a_named_error_and_the_run_stops(rm_path):
    for how in ("kill", "stop"):
        service = RewardService(RewardSpec(function="model", model=RewardModelSpec(path=rm_path, timeout_s=2)))
        try:
            os.kill(service.model.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            with pytest.raises(RewardFunctionBroken, match="died" if how == "kill" else "did not answer within"):
                asyncio.run(service.score("1+1=", "2", {}))
            with pytest.raises(RewardFunctionBroken):  # and every sample after it
                asyncio.run(service.score("1+2=", "3", {}))
        finally:
            if how == "stop":
                os.kill(service.model.pid, signal.SIGKILL)
            service.close()


def test_a_folder_that_is_not_a_one_label_classifier_is_refused_before_anything_starts(tiny_model_path, tmp_path):
    with pytest.raises(ModelCheckError, match="not a sequence classifier"):
        resolve_reward_model_path(tiny_model_path)  # a causal LM
    two = tmp_path / "two-labels"
    two.mkdir()
    (two / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"],
                                                 "id2label": {"0": "bad", "1": "good"}}))
    with pytest.raises(ModelCheckError, match="2 labels"):
        resolve_reward_model_path(str(two))
    with pytest.raises(ModelCheckError, match="not a folder"):
        resolve_reward_model_path(str(tmp_path / "absent"))
    assert resolve_reward_model_path(BUILTIN).endswith(os.path.basename(ensure_tiny_reward_model(progress=False)))


def test_a_worker_that_cannot_load_its_folder_says_why(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"],
                                                      "num_labels": 1, "model_type": "qwen2"}))
    c = RewardModelClient(RewardModelSpec(path=str(tmp_path)))
    with pytest.raises(RewardModelError, match="cannot be loaded"):
        c.start()


def test_the_reward_model_mixes_with_rules_by_weight_and_reports_both_parts(rm_path):
    spec = RewardSpec(components=[{"function": "model", "weight": 0.5}, {"function": "numeric_match", "weight": 2.0}],
                      model={"path": rm_path})
    service = RewardService(spec)
    try:
        score = asyncio.run(service.score("12+30=", "42", {"answer": "42"}))
        model = service.model.reward(Scorer(rm_path).logits(["12+30=42"])[0])
        assert score.parts == {"model": pytest.approx(model, abs=1e-6), "numeric_match": 1.0}
        assert score.reward == pytest.approx(0.5 * model + 2.0, abs=1e-6)
    finally:
        service.close()


@pytest.mark.parametrize("reward, message", [
    ({"function": "model"}, "needs reward.model"),
    ({"function": "numeric_match", "model": {"path": "builtin:tiny-rm"}}, "nothing scores with it"),
    ({"components": [{"function": "model"}, {"function": "model", "name": "again"}], "model": {"path": "x"}},
     "at most one component runs reward.model"),
    ({"components": [{"function": "model", "params": {"answer": "1"}}], "model": {"path": "x"}}, "takes no params"),
    ({"function": "model", "model": {"path": "x", "micro_batch": 0}}, "micro_batch"),
])
def test_a_reward_model_spec_that_cannot_work_is_refused_naming_why(reward, message):
    with pytest.raises(SpecError, match=message):
        validate_spec({"name": "x", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"}, "reward": reward})
