"""rollout.cpu_single_process: vLLM's model runs inside its engine core process (no worker
process to spin-wait on), generates the model's greedy tokens, and takes weight updates."""
import asyncio
import os

import psutil
import pytest
import torch

from tests.workers.helpers import perturb
from workers.rollout.engine import RolloutEngine
from workers.models.tinymodel import encode
from workers.weights.sync import serialize_state_dict, tensors_checksum
from workers.weights.update import InlineWeights

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_a_single_process_engine_generates_the_same_and_takes_updates(loop, tiny_model_path, hf_model):
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    single = RolloutEngine(tiny_model_path, update_mode="keep", max_model_len=256, cpu_single_process=True)
    loop.run_until_complete(single.start())
    try:
        assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == before  # only that engine's start saw it
        (core,) = single.core_pids()
        assert psutil.Process(core).children() == []  # no worker process

        prompts = [encode(f"{a}+{b}=") for a, b in [(12, 34), (5, 67), (80, 9)]]

        async def greedy(e):
            return await asyncio.gather(*(e.generate(p, 10, 0.0, ignore_eos=True) for p in prompts))

        # what the model computes (the two-process engine's match: tests/workers/rollout/test_engine_server.py)
        assert [c.token_ids for c in loop.run_until_complete(greedy(single))] == [_hf_greedy(hf_model, p, 10)
                                                                                  for p in prompts]
        state = perturb(hf_model, seed=21)
        loop.run_until_complete(single.update_weights(InlineWeights(serialize_state_dict(state)), 1))
        assert loop.run_until_complete(single.weights_checksum()) == tensors_checksum(state)
        assert all(c.versions.runs == [[1, 10]] for c in loop.run_until_complete(greedy(single)))
    finally:
        single.shutdown()
