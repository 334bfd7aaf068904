"""The real engine on the tiny model: vLLM (CPU) rollouts, DeepSpeed training and
in-flight weight updates. One engine serves the whole module (start-up is slow)."""
import asyncio
import dataclasses

import pytest
import torch

from tests.workers.helpers import perturb

from workers.rollout.engine import RolloutEngine, continue_on
from workers.models.tinymodel import encode
from workers.train.algorithms import token_logprobs
from workers.weights.sync import serialize_state_dict, tensors_checksum
from workers.weights.update import InlineWeights

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def _perturbed_blob(model, scale=0.05, seed=0):
    return InlineWeights(serialize_state_dict(perturb(model, scale, seed)))


async def _logprob_gap(engine, model, prompt="12+34="):
    """Max |engine behaviour log-prob − HF log-prob| over a sampled completion."""
    ids = encode(prompt)
    comp = await engine.generate(ids, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    return max(abs(a - b) for a, b in zip(_model_logprobs(model, comp), comp.logprobs))


async def _run_with_update(engine, blob, version, n=12, max_tokens=120):
    tasks = [asyncio.create_task(engine.generate(encode(f"{i}+{i}="), max_tokens, 1.0, ignore_eos=True)) for i in range(n)]
    start = engine.generated_tokens
    while engine.generated_tokens < start + 20 * n:  # let every request get going under the old weights
        await asyncio.sleep(0.02)
    timing = await engine.update_weights(blob, version)
    return await asyncio.gather(*tasks), timing


def test_in_flight_update_changes_weights_while_requests_run_and_all_finish(loop, engine, hf_model):
    assert loop.run_until_complete(_logprob_gap(engine, hf_model)) < 1e-3  # same weights to begin with
    blob = _perturbed_blob(hf_model)
    completions, timing = loop.run_until_complete(_run_with_update(engine, blob, version=1))
    assert all(c.length == 120 and len(c.logprobs) == 120 for c in completions)
    spanning = [c for c in completions if [v for v, _ in c.versions.runs] == [0, 1]]
    assert spanning, [c.versions.runs for c in completions]
    assert all(c.versions.tokens == 120 for c in completions)
    assert timing.load_ms > 0 and timing.sync_ms >= timing.load_ms
    # the engine now computes exactly what the updated model computes
    assert loop.run_until_complete(_logprob_gap(engine, hf_model)) < 1e-3


def test_direct_weight_load_after_the_first_update_matches_the_model_exactly(loop, engine, hf_model):
    # The first load goes through vLLM's layerwise reload; later ones copy into the live
    # parameters and repack the CPU GEMM weights. Both must give the model's log-probs.
    paths = []
    for seed in (1, 2):
        blob = _perturbed_blob(hf_model, scale=0.02, seed=seed)
        paths.append(loop.run_until_complete(engine.engine.collective_rpc("fluxrl_load_weights", args=(blob.data,)))[0]["path"])
        assert loop.run_until_complete(_logprob_gap(engine, hf_model)) < 1e-3
    assert paths[-1] == "direct", paths


def test_interrupted_request_resumes_from_its_prefix(loop, engine, hf_model):
    engine.update_mode = "interrupt"
    try:
        blob = _perturbed_blob(hf_model, seed=1)
        completions, _ = loop.run_until_complete(_run_with_update(engine, blob, version=2, n=8, max_tokens=150))
    finally:
        engine.update_mode = "keep"
    assert all(c.length == 150 and len(c.logprobs) == 150 for c in completions)  # the budget is kept
    resumed = [c for c in completions if c.resubmits >= 1]
    assert resumed
    for c in resumed:  # prefix under the old version, the rest under the new one
        assert [v for v, _ in c.versions.runs] == [1, 2]
    assert loop.run_until_complete(_logprob_gap(engine, hf_model)) < 1e-3


def test_trainer_and_engine_weights_match_after_a_training_step(loop, engine, tiny_model_path):
    from workers.spec import validate_spec
    from workers.train.trainer import Trainer
    from workers.train.samples import TrainSample

    spec = validate_spec({"name": "t", "model": {"path": tiny_model_path}, "task": {"dataset": "gen:add"},
                          "algorithm": {"lr": 1e-3}, "trainer": {"zero_stage": 1}})
    trainer = Trainer(spec, tiny_model_path, threads=1)
    before = tensors_checksum(dict(trainer.state_dict()))
    async def four():
        return await asyncio.gather(*(engine.generate(encode("7+8="), 8, 1.0) for _ in range(4)))

    comps = loop.run_until_complete(four())
    batch = [TrainSample(c.prompt_ids, c.token_ids, c.logprobs, adv) for c, adv in zip(comps, [1.0, -1.0, 0.5, -0.5])]
    stats = trainer.train_step(batch)
    assert stats["trainer/micro_batches"] >= 1 and trainer.version == 1
    state = dict(trainer.state_dict())
    assert tensors_checksum(state) != before  # the step changed the policy
    loop.run_until_complete(engine.update_weights(InlineWeights(serialize_state_dict(state)), 3))
    assert loop.run_until_complete(engine.weights_checksum()) == tensors_checksum(
        {k: v for k, v in state.items()})
    assert loop.run_until_complete(_logprob_gap(engine, trainer.engine.module)) < 1e-3


def test_a_handed_off_request_finishes_on_another_engine_with_its_prefix_and_budget(loop, engine, tiny_model_path, hf_model):
    other = RolloutEngine(tiny_model_path, index=1, update_mode="keep", max_model_len=256)
    loop.run_until_complete(other.start())
    try:
        # both engines hold the same weights (the model's)
        blob = InlineWeights(serialize_state_dict(hf_model.state_dict()))
        version = engine.version + 1
        loop.run_until_complete(engine.update_weights(blob, version))
        loop.run_until_complete(other.update_weights(blob, version))

        async def six_then_hand_off_three():
            tasks = [asyncio.create_task(engine.generate(encode(f"{i}+{i}="), 90, 1.0, ignore_eos=True)) for i in range(6)]
            while engine.generated_tokens < start + 6 * 15:
                await asyncio.sleep(0.02)
            moved = await engine.hand_off(3)
            done = await asyncio.gather(*tasks)
            return moved, done, await asyncio.gather(*(continue_on(other, c, 90, 1.0, ignore_eos=True) if c.finish_reason == "handed_off"
                                                       else asyncio.sleep(0, c) for c in done))

        start = engine.generated_tokens
        moved, partial, final = loop.run_until_complete(six_then_hand_off_three())
        assert moved == 3
        handed = [c for c in partial if c.finish_reason == "handed_off"]
        assert len(handed) == 3 and all(0 < c.length < 90 for c in handed)
        assert all(c.length == 90 and len(c.logprobs) == 90 and c.versions.tokens == 90 for c in final)
        moved_on = [f for p, f in zip(partial, final) if p.finish_reason == "handed_off"]
        assert all(f.engine == 1 and f.resubmits == 1 for f in moved_on)
        for p, f in zip(partial, final):
            assert f.token_ids[: p.length] == p.token_ids  # the prefix is kept
        # the continued tokens were sampled from the same policy: their log-probs are the model's
        gap = max(abs(a - b) for f in moved_on for a, b in zip(_model_logprobs(hf_model, f), f.logprobs))
        assert gap < 1e-3
    finally:
        other.shutdown()


def _model_logprobs(model, comp):
    with torch.no_grad():
        logits = model(torch.tensor([comp.prompt_ids + comp.token_ids])).logits[0].float().log_softmax(-1)
    n = len(comp.prompt_ids)
    return [logits[n - 1 + i, t].item() for i, t in enumerate(comp.token_ids)]


def test_a_group_request_gives_n_distinct_samples_with_the_models_logprobs(loop, engine, hf_model):
    busy = engine.busy_seconds()
    # an open-ended prompt (the sum's operand): one shared seed would make all 8 the same
    comps = loop.run_until_complete(engine.generate_group(encode("12+"), 8, max_tokens=12, temperature=1.0,
                                                          seed=7, ignore_eos=True))
    assert len(comps) == 8
    assert all(c.length == 12 and len(c.logprobs) == 12 for c in comps)
    assert all(c.versions.runs == [[engine.version, 12]] and c.finish_reason == "length" for c in comps)
    assert len({tuple(c.token_ids) for c in comps}) >= 6  # a seed per request: sample i gets seed + i
    gap = max(abs(a - b) for c in comps for a, b in zip(_model_logprobs(hf_model, c), c.logprobs))
    assert gap < 1e-3  # each sample's behaviour log-probs are the model's
    assert not engine.active and engine.busy_seconds() > busy  # every sample counted running, then done


def test_under_top_k_and_top_p_the_trainers_truncated_logprobs_are_the_behaviour_logprobs(loop, engine, hf_model):
    """vLLM samples from the top-k/top-p truncated distribution and reports its log-probs;
    the trainer's (workers.train.algorithms.token_logprobs) take the same truncation, so an
    on-policy token's importance weight is 1 (the full-vocabulary log-probs are not)."""
    full = engine.sampling
    engine.sampling = dataclasses.replace(full, top_k=3, top_p=0.7)
    try:
        comps = loop.run_until_complete(engine.generate_group(encode("12+"), 8, max_tokens=12, temperature=0.8,
                                                              seed=11, ignore_eos=True))
    finally:
        engine.sampling = full
    truncated_gap = untruncated_gap = 0.0
    for c in comps:
        with torch.no_grad():
            logits = hf_model(torch.tensor([c.prompt_ids + c.token_ids])).logits[:, :-1].float() / 0.8
        targets = torch.tensor([c.prompt_ids + c.token_ids])[:, 1:]
        n = len(c.prompt_ids)
        ours, _ = token_logprobs(logits, targets, top_k=3, top_p=0.7)
        plain, _ = token_logprobs(logits, targets)
        for i, behav in enumerate(c.logprobs):
            truncated_gap = max(truncated_gap, abs(ours[0, n - 1 + i].item() - behav))
            untruncated_gap = max(untruncated_gap, abs(plain[0, n - 1 + i].item() - behav))
    assert truncated_gap < 1e-3  # importance weight exp(behav − trainer) = 1 on-policy
    assert untruncated_gap > 0.05  # the truncation mattered for these samples


@pytest.mark.parametrize("by", ["stop_token_ids", "stop"])
def test_a_group_request_stops_each_sample_at_its_own_stop(loop, engine, by):
    from collections import Counter
    from dataclasses import replace

    from workers.models.tinymodel import decode

    def group(sampling):
        saved, engine.sampling = engine.sampling, sampling
        try:
            return loop.run_until_complete(engine.generate_group(encode("12+34="), 8, max_tokens=40,
                                                                 temperature=1.0, seed=3, ignore_eos=True))
        finally:
            engine.sampling = saved

    # stop at the digit these samples produce most often (the policy depends on the tests before)
    digit = Counter(ch for c in group(engine.sampling) for ch in decode(c.token_ids)).most_common(1)[0][0]
    stop = (encode(digit)[0],) if by == "stop_token_ids" else (digit,)
    comps = group(replace(engine.sampling, **{by: stop}))
    texts = [decode(c.token_ids) for c in comps]
    assert any(c.finish_reason == "stop" for c in comps), (digit, texts)
    for c, text in zip(comps, texts):
        assert len(c.logprobs) == c.length == c.versions.tokens
        assert digit not in text[:-1]  # each sample stops at its own first stop (kept in the output)
        assert text.endswith(digit) == (c.finish_reason == "stop")


def test_a_group_spanning_a_keep_update_labels_each_sample_token_by_token(loop, engine, hf_model):
    version = engine.version + 1
    blob = _perturbed_blob(hf_model, seed=3)

    async def groups_across_an_update():
        tasks = [asyncio.create_task(engine.generate_group(encode(f"{i}+{i}="), 6, 120, 1.0, ignore_eos=True))
                 for i in range(2)]
        start = engine.generated_tokens
        while engine.generated_tokens < start + 20 * 12:  # every sample under way under the old weights
            await asyncio.sleep(0.02)
        assert len(engine.active) == 12  # one running sequence per sample
        timing = await engine.update_weights(blob, version)
        return [c for group in await asyncio.gather(*tasks) for c in group], timing

    comps, timing = loop.run_until_complete(groups_across_an_update())
    assert all(c.length == 120 and len(c.logprobs) == 120 and c.versions.tokens == 120 for c in comps)
    runs = [[v for v, _ in c.versions.runs] for c in comps]
    assert all(r in ([version - 1], [version - 1, version], [version]) for r in runs), runs
    assert [version - 1, version] in runs, runs
    assert timing.gen_stall_ms is not None  # the stall is measured on the samples' token streams
    assert loop.run_until_complete(_logprob_gap(engine, hf_model)) < 1e-3  # the update took
