"""The KL reference as an inference stage (algorithm.kl_reference: stage,
workers/train/reference.py): its worker computes the log-probs the trainer's own
reference forward computes (under the rollout's temperature and top-k/top-p), a step
trained on them is the step with the reference inside the trainer, and samples that
finish together share its forwards."""
import asyncio
import math

import pytest
import torch

from tests.workers.train.test_trainer import _batch
from workers.spec import validate_spec
from workers.train.reference import ReferenceScorer, ReferenceStage, scorer_config
from workers.train.trainer import Trainer

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]


def _spec(where: str, **inference):
    return validate_spec({
        "name": "ref", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add?max_digits=2"},
        "algorithm": {"lr": 1e-2, "warmup_steps": 0, "kl_coef": 0.5, "minibatches": 1, "kl_reference": where},
        "rollout": {"temperature": 0.8, "top_k": 20, "top_p": 0.9}, "inference": inference,
    })


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


def _in_step_reference(trainer, batch):
    ids, att, *_ = trainer._tensors(batch, trainer.engine.device)
    with torch.no_grad():
        ref, _ = trainer._logprobs(trainer.reference, ids, att)
    return [ref[i, len(s.prompt_ids) - 1: len(s.prompt_ids) - 1 + len(s.token_ids)].tolist()
            for i, s in enumerate(batch)]


def test_the_stage_computes_the_trainers_own_reference_log_probs_under_truncation(tiny_model_path, hf):
    spec = _spec("trainer")
    trainer = Trainer(spec, tiny_model_path, threads=1)
    batch = _batch(hf, n=6)
    batch[1].token_ids = batch[1].token_ids[:2]  # rows of different lengths: padding in both
    batch[1].behav_logprobs = batch[1].behav_logprobs[:2]
    inside = _in_step_reference(trainer, batch)
    stage = ReferenceScorer(**scorer_config(spec, tiny_model_path, pad_id=0)).logprobs(
        [(s.prompt_ids, s.token_ids) for s in batch])
    assert [len(x) for x in stage] == [len(s.token_ids) for s in batch]
    assert max(abs(a - b) for x, y in zip(inside, stage) for a, b in zip(x, y)) < 1e-5
    assert all(math.isfinite(v) for x in stage for v in x)


def test_a_micro_batch_over_micro_batch_tokens_is_split_into_forwards_with_the_same_log_probs(tiny_model_path, hf):
    batch = _batch(hf, n=6)
    items = [(s.prompt_ids, s.token_ids) for s in batch]
    whole = ReferenceScorer(**scorer_config(_spec("stage"), tiny_model_path, pad_id=0))
    capped = ReferenceScorer(**scorer_config(_spec("stage", micro_batch_tokens=16), tiny_model_path, pad_id=0))
    widths = []
    forward = capped._forward
    capped._forward = lambda chunk: widths.append(max(len(p) + len(t) for p, t in chunk) * len(chunk)) or forward(chunk)
    got, want = capped.logprobs(items), whole.logprobs(items)
    assert len(widths) > 1 and all(w <= 16 or w == max(len(p) + len(t) for p, t in items) for w in widths)
    assert [len(x) for x in got] == [len(t) for _, t in items]
    assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y)) < 1e-5


def test_a_step_on_the_stages_log_probs_is_the_step_with_the_reference_in_the_trainer(tiny_model_path, hf):
    batch = _batch(hf)
    inside = Trainer(_spec("trainer"), tiny_model_path, threads=1)
    outside = Trainer(_spec("stage"), tiny_model_path, threads=1)
    assert outside.reference is None  # the trainer holds one model less
    scorer = ReferenceScorer(**scorer_config(_spec("stage"), tiny_model_path, pad_id=0))
    staged = [type(s)(**{**s.__dict__, "ref_logprobs": r})
              for s, r in zip(batch, scorer.logprobs([(s.prompt_ids, s.token_ids) for s in batch]))]
    for _ in range(2):  # the second step has a KL to pull on
        a, b = inside.train_step(batch), outside.train_step(staged)
    assert b["loss/kl"] > 1e-4 and b["loss/kl"] == pytest.approx(a["loss/kl"], rel=1e-4, abs=1e-7)
    one, two = inside.state_dict(), outside.state_dict()
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-5
    with pytest.raises(RuntimeError, match="without its reference log-probs"):
        outside.train_step(batch)  # a sample that skipped the stage is an error, not a KL of 0


def test_the_stage_worker_takes_samples_that_finish_together_in_micro_batches(tiny_model_path, hf):
    spec = _spec("stage", micro_batch=8, max_wait_ms=200)
    batch = _batch(hf, n=20)
    stage = ReferenceStage(spec, tiny_model_path, pad_id=0)
    stage.start()
    try:
        async def all_of_them():
            return await asyncio.gather(*(stage.logprobs(s.prompt_ids, s.token_ids) for s in batch))
        got = asyncio.run(all_of_them())
        stats = stage.stats()
        assert (stats["batches"], stats["samples"]) == (3, 20)  # 8 + 8 + 4
    finally:
        stage.close()
    assert stage.proc.poll() is not None
    want = ReferenceScorer(**scorer_config(spec, tiny_model_path, pad_id=0)).logprobs(
        [(s.prompt_ids, s.token_ids) for s in batch])
    assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y)) < 1e-6


def test_a_reference_stage_without_a_kl_term_is_refused():
    from workers.spec import SpecError

    with pytest.raises(SpecError, match="kl_coef > 0"):
        validate_spec({"name": "x", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
                       "algorithm": {"kl_reference": "stage"}})
