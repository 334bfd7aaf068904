"""The engine runs RL on Hugging Face models of several architectures, each with its own
tokenizer (byte-level BPE or Unigram), chat template and end-of-turn ids: async RL with
in-flight (`keep`) updates, end to end, on models built locally (workers/models/modelzoo.py).
The run's own engine is also the check that vLLM on the CPU generates what transformers
generates greedily on these models (its evaluation before training), and that after the
in-flight updates it samples from exactly the trainer's final weights.

That RL raises the held-out reward is asserted on Qwen2 (50 steps). On Llama and GPT-2
the run is short: what depends on the architecture (tokenizer, template, stop ids, the
weight layout vLLM loads an update into, GPT-2's transposed Conv1D included) is checked
exactly there, while a rise of a few hundredths after 150 steps is a noisy figure (GPT-2
gave +0.066 and +0.023 in two runs of the same recipe). ``FLUXRL_ZOO_RL_ALL=1`` runs all
three for 150 steps with the rise asserted (the table in docs/models.md)."""
import asyncio
import json
import os

import pytest
import torch

from workers.coord.controller import Controller
from workers.models.hf_eval import greedy_accuracy
from workers.models.modelzoo import ensure_zoo_model, greedy_completions
from workers.models.zoo_data import write_chat_dataset
from workers.spec import validate_spec
from workers.tasks.datasets import load_rows

ALL = os.environ.get("FLUXRL_ZOO_RL_ALL") == "1"
# Qwen2's held-out sampled reward rose +0.101 in 40 steps, +0.152 in 80 and +0.146 in 150 (one run
# each, 2026-11-26): the rise is there early, so the default run takes 50 steps, ALL the 150 of docs/models.md.
RL_STEPS = 150 if ALL else 50
SHORT_STEPS = 6  # past the warm-up and the staleness bound: what the checks of every architecture need
ARCHS = {"qwen2": RL_STEPS, "llama": RL_STEPS if ALL else SHORT_STEPS, "gpt2": RL_STEPS if ALL else SHORT_STEPS}
RISE = 0.03  # 3200 samples before and after: the difference's standard error is about 0.01


class RecordingController(Controller):
    """Keeps every completion with the temperature it was sampled at, and every text scored."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generated, self.scored = [], []

    async def _generate(self, engine, row, temperature):
        comp = await super()._generate(engine, row, temperature)
        self.generated.append((row, temperature, comp))
        return comp

    async def _score(self, row, comp):
        sample = await super()._score(row, comp)
        self.scored.append((comp.token_ids, sample.text))
        return sample


def _spec(model, data, steps):
    return validate_spec({
        "name": "zoo", "model": {"path": str(model)},
        "task": {"dataset": str(data), "eval_size": 200},
        "reward": {"function": "numeric_match"},
        "algorithm": {"loss": "ppo", "group_size": 8, "lr": 1e-4, "warmup_steps": 2, "adv_std_norm": True},
        "rollout": {"max_tokens": 16, "temperature": 1.0, "update_mode": "keep"},
        "schedule": {"mode": "async", "max_staleness": 2, "batch_prompts": 16},
        "stop": {"max_steps": steps, "max_minutes": 12},
        # 16 samples per held-out prompt measure the rise; one each is enough otherwise
        "eval": {"every_steps": 0, "prompts": 200, "samples": 16 if steps == RL_STEPS else 1},
    })


def _hf_logprobs(model, prompt_ids, token_ids, temperature):
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1)


@pytest.mark.engine
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a == "qwen2" else a for a in ARCHS])
def test_async_keep_trains_a_chat_model_of_this_architecture(arch, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model_dir = ensure_zoo_model(arch)
    data = write_chat_dataset(tmp_path / "chat.jsonl", 1500, seed=7, two_digit=True)
    steps = ARCHS[arch]
    spec = _spec(model_dir, data, steps)
    controller = RecordingController(spec, tmp_path / "out", progress=False)
    result = asyncio.run(controller.run())
    assert result.steps == steps and result.staleness_max <= 2

    # The ids vLLM generated decode to the text that was scored, by the tokenizer file
    # itself (not the engine's tokenizer object), and end on one of the model's stop ids.
    saved = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stops = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    stops = stops if isinstance(stops, list) else [stops]
    assert len(stops) >= 2
    for token_ids, text in controller.scored:
        assert saved.decode(token_ids, skip_special_tokens=True) == text
    finished = [c for _, _, c in controller.generated if c.finish_reason == "stop"]
    assert finished and all(c.token_ids[-1] in stops for c in finished)

    # Prompts are the chat template's rendering, encoded by the same tokenizer file.
    row, _, comp = controller.generated[-1]
    rendered = controller.fleet.prompts.tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True,
                                                               tokenize=False)
    assert comp.prompt_ids == saved.encode(rendered, add_special_tokens=False).ids

    # vLLM on the CPU generates what transformers generates greedily: the engine's greedy
    # completions of the held-out prompts by the starting weights (the evaluation before
    # training) are HF's greedy completions, token for token, up to the first stop id.
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    greedy = [c for _, t, c in controller.generated if t == 0 and c.versions.runs == [[0, c.length]]]
    assert len(greedy) == len(controller.evaluation.rows) >= 100, len(greedy)
    pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    assert greedy_completions(hf, [c.prompt_ids for c in greedy], stops, pad_id) == [c.token_ids for c in greedy]

    # Behaviour log-probs (vLLM, at sampling temperature) match the HF model's within 1e-3
    # for sequences produced entirely by the starting weights.
    first = [c for _, t, c in controller.generated if t > 0 and c.versions.runs == [[0, c.length]]][:16]
    assert len(first) >= 8
    for c in first:
        hf_lp = _hf_logprobs(hf, c.prompt_ids, c.token_ids, spec.rollout.temperature)
        assert torch.allclose(hf_lp, torch.tensor(c.logprobs), atol=1e-3), (hf_lp, c.logprobs)

    # The engine samples from exactly the trainer's final weights after the in-flight
    # updates: the final evaluation's sampled completions (all by the last version) have
    # the log-probs HF computes with final_model.
    final_hf = AutoModelForCausalLM.from_pretrained(result.final_model, dtype=torch.float32).eval()
    last = max(run[0] for _, _, c in controller.generated for run in c.versions.runs)
    final = [c for _, t, c in controller.generated if t > 0 and c.versions.runs == [[last, c.length]]][-16:]
    assert last == steps and len(final) == 16, (last, len(final))
    moved = 0.0  # how far the starting weights' log-probs are: the check can tell the two apart
    for c in final:
        hf_lp = _hf_logprobs(final_hf, c.prompt_ids, c.token_ids, spec.rollout.temperature)
        assert torch.allclose(hf_lp, torch.tensor(c.logprobs), atol=1e-3), (hf_lp, c.logprobs)
        start_lp = _hf_logprobs(hf, c.prompt_ids, c.token_ids, spec.rollout.temperature)
        moved = max(moved, (start_lp - torch.tensor(c.logprobs)).abs().max().item())
    assert moved > 0.01, moved

    # An HF greedy evaluation of final_model agrees with the engine's held-out figure
    # (same tokenizer, template and answer rule).
    _, held_out = load_rows(str(data), eval_size=200)
    independent = greedy_accuracy(result.final_model, spec, held_out)
    assert independent == pytest.approx(result.accuracy_after, abs=0.0251), (independent, result.accuracy_after)

    print(f"{arch}: held-out sampled reward {result.sampled_reward_before:.3f} -> {result.sampled_reward_after:.3f}, "
          f"greedy accuracy {result.accuracy_before:.3f} -> {result.accuracy_after:.3f}")
    # The shipped warm start answers some prompts (0.1 is 20 of 200).
    assert result.accuracy_before > 0.1, result.accuracy_before
    if steps == RL_STEPS:
        # RL raises the held-out reward: the mean reward of 16 samples per held-out prompt
        # at the training temperature, 3200 in all (what RL optimises; on these warm starts
        # the greedy argmax moves later, on Qwen2 first).
        assert result.sampled_reward_after > result.sampled_reward_before + RISE, (
            result.sampled_reward_before, result.sampled_reward_after)
