"""RLHFuse's intra-stage fusion (workers/train/pipeline.py): the schedules on an ideal
machine (exact), and one step of the actor and the critic on two rank processes, whose
gradients are the unsplit models' whichever schedule runs it."""
import random

import pytest
import torch

from workers.train.pipeline import (MODELS, Hyper, Op, fused_schedule, micro_batches, one_f_one_b,
                                    reference_gradients, sequential_schedule, simulate, split_layers)
from workers.train.pipeline_group import run_step
from workers.train.samples import TrainSample


def test_one_f_one_b_fills_the_pipe_then_alternates_forward_and_backward():
    assert one_f_one_b(0, 2, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert one_f_one_b(1, 2, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert one_f_one_b(0, 3, 1) == [("F", 0), ("B", 0)]  # fewer micro-batches than the pipe is deep


def test_layers_split_into_contiguous_even_stages_the_earlier_taking_the_extra():
    assert split_layers(3, 2) == [range(0, 2), range(2, 3)]
    assert split_layers(4, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    with pytest.raises(ValueError, match="cannot make"):
        split_layers(2, 3)


def test_on_an_ideal_machine_the_fused_schedule_fills_the_bubbles_of_two_pipelines_run_one_after_the_other():
    # forward 1, backward 2: each model's work on a rank is 4 × 3 = 12 units, 24 for both
    _, sequential, busy = simulate(sequential_schedule(2, 4))
    assert sequential == 29 and busy == [24 / 29, 24 / 29]
    _, fused, busy = simulate(fused_schedule(2, 4))
    assert fused == 26 and busy == [24 / 26, 24 / 26]
    assert simulate(sequential_schedule(3, 6))[1] == 46 and simulate(fused_schedule(3, 6))[1] == 41


def test_the_fused_schedule_keeps_each_models_own_1f1b_order_on_every_rank():
    sequential, fused = sequential_schedule(3, 5), fused_schedule(3, 5)
    for rank in range(3):
        assert sorted(map(repr, fused[rank])) == sorted(map(repr, sequential[rank]))
        for model in MODELS:
            assert [op for op in fused[rank] if op.model == model] == [op for op in sequential[rank] if op.model == model]
    assert fused != sequential  # interleaved, not one model after the other


def test_a_schedule_that_waits_on_itself_is_refused():
    # rank 0 starts with a backward that needs rank 1's, which needs rank 0's forward after it
    stuck = [[Op("B", "actor", 0), Op("F", "actor", 0)], [Op("F", "actor", 0), Op("B", "actor", 0)]]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(stuck)


def _samples(n: int, seed: int = 0) -> list[TrainSample]:
    """GAE-trained samples of uneven lengths, as Trainer.critic_targets leaves them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(3, 128) for _ in range(rng.randint(3, 6))]
        k = rng.randint(2, 9)
        out.append(TrainSample(prompt, [rng.randrange(3, 128) for _ in range(k)],
                               [-rng.uniform(3.0, 6.0) for _ in range(k)], 0.0,
                               token_advantages=[rng.uniform(-1, 1) for _ in range(k)],
                               values=[rng.uniform(-0.5, 0.5) for _ in range(k)],
                               returns=[rng.uniform(-1, 1) for _ in range(k)]))
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_step_on_two_ranks_gives_the_unsplit_models_gradients_with_either_schedule(tiny_model_path):
    mbs = micro_batches(_samples(12), rows=3)
    assert len(mbs) == 4
    hyper = Hyper(denominator=float(sum(mb["mask"].sum() for mb in mbs)), head_seed=7)
    want = reference_gradients(tiny_model_path, mbs, hyper)
    assert all(float(g.abs().max()) > 0 for g in want["critic"].values())  # a random head: the trunk learns too
    for kind in ("sequential", "fused"):
        report = run_step(tiny_model_path, mbs, kind, stages=2, hyper=hyper, grads=True)
        assert report.schedule == kind and len(report.compute_s) == 2 and 0 <= report.bubble < 1
        got = {**report.grads[0], **report.grads[1]}
        for model in MODELS:
            for name, expected in want[model].items():
                g = got[f"{model}/{name}"]  # every parameter has its gradient on some rank
                scale = float(expected.abs().max()) + 1e-12
                assert float((g - expected).abs().max()) <= 1e-5 * scale, (kind, model, name)
        # the tied embedding: the first stage's and the last's copies both hold the summed gradient
        first = report.grads[0]["actor/model.embed_tokens.weight"]
        last = report.grads[1]["actor/model.embed_tokens.weight"]
        assert torch.equal(first, last)
