"""Episodes on the real engine (the tiny model) under each update mode: one episode's turns
span weight updates, every generated token keeps the version that produced it and its own
behaviour log-prob (checked against the model at that version), observation tokens are
masked, and the trainer packs exactly the engine's ids."""
import asyncio

import pytest
import torch

from tests.workers.helpers import perturb
from workers.agents.api import Observation, StepResult
from workers.agents.episode import Budgets, engine_ids, run_episode, trained_versions
from workers.agents.render import ObservationRenderer
from workers.coord.generation import Group, Sample
from workers.coord.trainer_work import train_samples
from workers.models.tinymodel import encode
from workers.spec import validate_spec
from workers.tasks.prompts import load_tokenizer
from workers.train.batching import trained_ids
from workers.weights.sync import serialize_state_dict
from workers.weights.update import InlineWeights

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

TURN_TOKENS = (40, 40, 150)  # the third turn is long: an update lands in the middle of it


class UpdatingEnv:
    """Three turns. After the first, the policy is updated between turns; after the second,
    an update is pushed while the third turn generates (``mid_turn``)."""

    def __init__(self, between, mid_turn):
        self.between, self.mid_turn, self.steps, self.closed = between, mid_turn, 0, False

    async def reset(self, row):
        pass

    async def step(self, text, token_ids):
        self.steps += 1
        if self.steps == 1:
            await self.between()
        elif self.steps == 2:
            self.mid_turn()
        return StepResult(Observation(f"r{self.steps}", "tool"), reward=0.0, done=self.steps >= 3)

    async def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def policies(tiny_model_path):
    """The policy's weights at each version this module pushes: v0 (the model) .. v6."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    states = {0: {k: t.clone() for k, t in model.state_dict().items()}}
    for v in range(1, 7):
        states[v] = {k: t.clone() for k, t in perturb(model, 0.03, seed=v).items()}
    return model, states


@pytest.fixture(scope="module")
def trainer(tiny_model_path):
    from workers.train.trainer import Trainer

    spec = validate_spec({"name": "episodes", "model": {"path": "builtin:tiny"},
                          "task": {"dataset": "gen:add?max_digits=2"}, "reward": {"function": "numeric_match"},
                          "algorithm": {"lr": 1e-3, "warmup_steps": 0, "group_size": 1}})
    return Trainer(spec, tiny_model_path, threads=1), spec


async def _episode(engine, states, first_version):
    """One episode whose turns span two updates: ``first_version`` + 1 between turns 1 and 2,
    + 2 pushed once the third turn has made 20 tokens."""
    renderer = ObservationRenderer(load_tokenizer(engine.model_path), None)
    mid: list[asyncio.Task] = []
    calls = []

    async def update(version):
        await engine.update_weights(InlineWeights(serialize_state_dict(states[version])), version)

    async def update_mid_turn():
        start = engine.generated_tokens
        while engine.generated_tokens < start + 20:
            await asyncio.sleep(0.005)
        await update(first_version + 2)

    async def generate(ids, max_tokens):
        n = min(max_tokens, TURN_TOKENS[len(calls)])
        calls.append(n)
        return await engine.generate(ids, n, 1.0, ignore_eos=True)

    env = UpdatingEnv(lambda: update(first_version + 1), lambda: mid.append(asyncio.create_task(update_mid_turn())))
    budgets = Budgets(max_turns=3, max_turn_tokens=150, max_episode_tokens=400, max_observation_tokens=16,
                      max_model_len=256, timeout_s=30.0)
    comp = await run_episode(generate, env, {"prompt": "12+34="}, encode("12+34="), budgets, renderer, chat=False)
    await asyncio.gather(*mid)
    assert env.closed
    return comp


def _check_logprobs_against_each_tokens_version(model, states, comp, whole_turns=True):
    """Every generated token's behaviour log-prob is the one the policy at its own version
    gives it (the engine's labels and log-probs are the token's own). ``whole_turns`` False
    (keep): only the tokens of each turn's first version; after a keep update lands mid-turn
    the request goes on over the KV cache its old weights computed (PipelineRL's in-flight
    semantics), which a fresh forward at the new version does not reproduce."""
    ids = torch.tensor([comp.prompt_ids + comp.token_ids])
    versions = comp.versions.per_token()
    n = len(comp.prompt_ids)
    todo = [(k, versions[k]) for t in comp.episode.turns for k in range(t.start, t.start + t.generated)
            if whole_turns or versions[k] == versions[t.start]]
    wrong = []
    for v in sorted({v for _, v in todo}):
        model.load_state_dict(states[v])
        with torch.no_grad():
            logp = model(ids).logits[0].float().log_softmax(-1)
        wrong += [(k, v) for k, u in todo
                  if u == v and abs(logp[n - 1 + k, comp.token_ids[k]].item() - comp.logprobs[k]) >= 1e-3]
    assert not wrong, wrong
    return len(todo)


def _check_trainer_packs_the_engines_ids(trainer_and_spec, comp):
    trainer, spec = trainer_and_spec
    sample = Sample({"prompt": "12+34="}, comp, "", 1.0)
    batch = train_samples(spec, Group([sample], 0, 0))
    ids, _, mask, behav, _, _ = trainer._tensors(batch, "cpu")
    # the ids at the trained positions, read back from the padded tensor, are the engine's
    assert trained_ids(ids, mask) == [engine_ids(comp)]
    loss_mask = comp.episode.loss_mask()
    cols = slice(len(comp.prompt_ids) - 1, len(comp.prompt_ids) - 1 + comp.length)
    assert mask[0, cols].tolist() == [float(m) for m in loss_mask]  # observation tokens masked
    on = mask[0, cols] > 0
    assert behav[0, cols][on].tolist() == pytest.approx([lp for lp, m in zip(comp.logprobs, loss_mask) if m],
                                                        abs=0)  # each token's own log-prob
    trainer.version = max(trained_versions(comp))
    stale = trainer._staleness(batch, mask.shape[1])[0, cols][on].tolist()
    assert stale == [trainer.version - v for v in trained_versions(comp)]
    stats = trainer.train_step(batch)
    assert torch.isfinite(torch.tensor(stats["loss/policy"]))


@pytest.mark.parametrize("mode, first", [("keep", 0), ("interrupt", 2), ("drain", 4)])
def test_an_episode_spanning_updates_trains_on_its_own_tokens_versions_and_logprobs(
        mode, first, loop, engine, policies, trainer):
    model, states = policies
    engine.update_mode = mode
    try:
        if engine.version != first:  # each mode starts from its own version, loaded plainly
            loop.run_until_complete(engine.update_weights(InlineWeights(serialize_state_dict(states[first])), first))
        comp = loop.run_until_complete(_episode(engine, states, first))
    finally:
        engine.update_mode = "keep"
    ep = comp.episode
    assert ep.end_reason == "done" and [t.generated for t in ep.turns] == list(TURN_TOKENS)
    assert all(t.observed > 0 for t in ep.turns[:2]) and ep.turns[2].observed == 0
    per_turn = [[v for v, _ in _runs(comp, t)] for t in ep.turns]
    assert per_turn[0] == [first] and per_turn[1] == [first + 1]
    if mode == "drain":  # the update waits for the running turn: the third turn is all first + 1
        assert per_turn[2] == [first + 1]
    else:  # the update lands mid-turn: the turn's tokens carry both versions
        assert per_turn[2] == [first + 1, first + 2], per_turn
    assert len(set(trained_versions(comp))) >= 2
    checked = _check_logprobs_against_each_tokens_version(model, states, comp, whole_turns=mode != "keep")
    assert checked >= sum(TURN_TOKENS[:2]) + 20
    _check_trainer_packs_the_engines_ids(trainer, comp)


def _runs(comp, turn):
    from workers.agents.episode import versions_of_turn

    return versions_of_turn(comp, turn)
