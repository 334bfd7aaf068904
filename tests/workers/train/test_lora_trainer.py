"""model.lora on the DeepSpeed trainer (tiny model, one rank): only the adapter trains, the
optimizer holds state for it alone, what leaves the trainer is the adapter with its config,
the KL reference is the run's starting policy (the base model with the adapter disabled, or
with model.lora.init the init adapter kept frozen), and a saved folder is the merged model
plus the adapter."""
import json
import os

import pytest
import torch

from workers.spec import validate_spec
from workers.train.trainer import Trainer
from workers.train.samples import TrainSample
from workers.weights.files import ADAPTER_CONFIG_KEY, trainer_weight_file, weight_file_metadata

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _spec(lora=LORA, **algorithm):
    return validate_spec({
        "name": "lora-trainer", "model": {"path": "builtin:tiny", "lora": lora},
        "task": {"dataset": "gen:add?max_digits=2"}, "reward": {"function": "numeric_match"},
        "algorithm": {"lr": 5e-2, "warmup_steps": 0, "minibatches": 1, **algorithm},
    })


def _batch(n=8):
    from workers.models.tinymodel import encode

    out = []
    for i in range(n):
        prompt = encode(f"{i + 3}+{2 * i}=")
        tokens = encode(str(i + 3 + 2 * i))[:3] or [5]
        out.append(TrainSample(prompt, tokens, [-1.0] * len(tokens), 1.0 if i % 2 else -1.0))
    return out


@pytest.fixture(scope="module")
def trainer(tiny_model_path):
    return Trainer(_spec(kl_coef=0.1), tiny_model_path, threads=1)


def test_only_the_adapter_trains_and_has_optimizer_state(trainer):
    module = trainer.engine.module
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 3 layers x (q_proj, v_proj) x rank 4 x (128 in + 128 out)
    assert sum(p.numel() for p in module.parameters() if p.requires_grad) == 3 * 2 * 4 * (128 + 128)
    optimized = [p for group in trainer.engine.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for p in module.parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    adapter = {k: v.clone() for k, v in trainer.state_dict().items()}
    trainer.train_step(_batch())
    after = dict(module.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in frozen.items())  # the base model did not move
    moved = trainer.state_dict()
    assert any(not torch.equal(moved[k], adapter[k]) for k in adapter)
    state = trainer.engine.optimizer.state
    assert all(p.requires_grad for p in state)  # Adam's moments exist for adapter parameters only


def test_weights_leaving_the_trainer_are_the_adapter_with_its_config(trainer, tmp_path):
    state = trainer.state_dict()
    assert state and all(k.startswith("base_model.model.") and ".lora_" in k for k in state)
    file = trainer_weight_file(trainer, str(tmp_path), trainer.version)
    config = json.loads(weight_file_metadata(file.path)[ADAPTER_CONFIG_KEY])
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    full = os.path.getsize(os.path.join(trainer.model_path, "model.safetensors"))
    assert file.size < 0.05 * full


def test_the_kl_reference_is_the_base_model_with_the_adapter_disabled(trainer, tiny_model_path):
    from transformers import AutoModelForCausalLM

    assert trainer.reference is None and trainer.has_reference  # no second copy of the model
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    s = _batch(1)[0]
    ids = torch.tensor([s.prompt_ids + s.token_ids])
    att = torch.ones_like(ids)
    ref, _ = trainer._reference_logprobs(ids, att)
    with torch.no_grad():
        expect, _ = trainer._logprobs(base, ids, att)
        policy, _ = trainer._logprobs(trainer.engine.module, ids, att)
    assert torch.allclose(ref, expect, atol=1e-5)
    assert not torch.allclose(policy, expect, atol=1e-4)  # the trained adapter is on outside the context


def test_a_saved_folder_is_the_merged_model_and_the_adapter(trainer, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer.save(str(tmp_path / "model"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")).eval()
    base = AutoModelForCausalLM.from_pretrained(trainer.model_path)
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "model" / "adapter")).eval()
    ids = torch.tensor([_batch(1)[0].prompt_ids])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-4)
        assert torch.allclose(merged(input_ids=ids).logits, trainer.engine.module(input_ids=ids).logits, atol=1e-4)


@pytest.mark.parametrize("spec, field", [
    ({"trainer": {"pipeline": {"stages": 2}}, "algorithm": {"advantage": "gae"}}, "trainer.pipeline.stages 1"),
    ({"trainer": {"zero_stage": 3}}, "trainer.zero_stage 0, 1 or 2"),
    ({"algorithm": {"advantage": "gae"}}, "algorithm.advantage 'group'"),
    ({"rollout": {"weight_transport": "collective"}}, "rollout.weight_transport 'rpc'"),
])
def test_lora_refuses_what_it_cannot_do_naming_the_field(spec, field):
    from workers.spec import SpecError

    doc = {"name": "x", "model": {"path": "builtin:tiny", "lora": LORA}, "task": {"dataset": "gen:add"}, **spec}
    with pytest.raises(SpecError) as err:
        validate_spec(doc)
    assert "model.lora needs" in str(err.value) and field in str(err.value)


def test_lora_fields_are_bounded_by_name():
    from workers.spec import SpecError

    doc = {"name": "x", "model": {"path": "builtin:tiny", "lora": {"rank": 0, "colour": 1}},
           "task": {"dataset": "gen:add"}}
    with pytest.raises(SpecError) as err:
        validate_spec(doc)
    fields = {e["field"] for e in err.value.errors}
    assert {"model.lora.rank", "model.lora.colour"} <= fields


def test_trainer_ranks_train_the_adapter_and_write_it_with_its_config(tiny_model_path, tmp_path):
    """Two data-parallel rank processes (ZeRO-2): rank 0 writes the adapter file itself."""
    from workers.train.ranks import TrainerGroup

    spec = _spec()
    spec.trainer.zero_stage = 2
    with TrainerGroup(spec, tiny_model_path, 2, 1, 0) as group:
        before = group.state_dict()
        group.train_step(_batch())
        file = trainer_weight_file(group, str(tmp_path), group.version)
        after = group.state_dict()
    assert set(before) == set(after) and all(".lora_" in k for k in after)
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert json.loads(weight_file_metadata(file.path)[ADAPTER_CONFIG_KEY])["r"] == 4


INIT_LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "o_proj", "down_proj"]}  # seeded_adapter's


@pytest.fixture(scope="module")
def init_folder(tiny_model_path, tmp_path_factory):
    """A PEFT adapter folder with B != 0 (model.lora.init)."""
    from tests.workers.rollout.lora_adapters import seeded_adapter

    folder = tmp_path_factory.mktemp("init") / "adapter"
    seeded_adapter(tiny_model_path, 5).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def from_adapter(tiny_model_path, init_folder):
    """A trainer that starts from ``init_folder``, with a KL term (kl_coef > 0)."""
    return Trainer(_spec(lora={**INIT_LORA, "init": str(init_folder)}, kl_coef=0.5), tiny_model_path, threads=1)


def test_a_run_starts_from_an_adapter_folder_and_refuses_one_that_does_not_fit(from_adapter, init_folder,
                                                                               tiny_model_path, tmp_path):
    """model.lora.init: the trainer's adapter is the folder's, and so are the first weights
    the engines get; an adapter of another rank is refused naming both ranks."""
    from safetensors.torch import load_file

    expected = load_file(str(init_folder / "adapter_model.safetensors"))
    sent = load_file(trainer_weight_file(from_adapter, str(tmp_path), 0).path)
    assert set(sent) == set(expected) and all(torch.equal(sent[k], expected[k]) for k in expected)
    assert max(t.abs().max().item() for k, t in expected.items() if "lora_B" in k) > 0  # not a fresh B = 0
    with pytest.raises(ValueError, match=r"model.lora.init: the adapter in .* has rank 8 \(model.lora.rank is 4\)"):
        Trainer(_spec(lora={**INIT_LORA, "init": str(init_folder), "rank": 4}), tiny_model_path, threads=1)


def test_a_run_from_an_adapter_has_its_starting_policy_as_kl_reference(from_adapter, init_folder, tiny_model_path,
                                                                        tmp_path):
    """model.lora.init with kl_coef > 0: the reference is the init adapter, kept frozen beside
    the one that trains, so the KL is 0 at step 0 (the base model would put it well above);
    the reference stage's worker computes the same reference; the frozen copy gets no
    gradient and leaves the trainer in none of the policy's weights, files or folders."""
    from safetensors.torch import load_file

    from workers.train.reference import ReferenceScorer, scorer_config

    trainer, spec = from_adapter, from_adapter.spec
    module = trainer.engine.module
    init = load_file(str(init_folder / "adapter_model.safetensors"))
    batch = _batch()
    ids, att, mask, *_ = trainer._tensors(batch, trainer.engine.device)
    mask = mask.bool()
    module.eval()
    with torch.no_grad():
        policy, _ = trainer._logprobs(module, ids, att)
    ref, _ = trainer._reference_logprobs(ids, att)
    assert torch.allclose(ref[mask], policy[mask], atol=1e-6)
    stage = ReferenceScorer(**scorer_config(validate_spec({**spec.model_dump(), "algorithm": {
        **spec.algorithm.model_dump(), "kl_reference": "stage"}}), tiny_model_path, pad_id=0))
    staged = stage.logprobs([(s.prompt_ids, s.token_ids) for s in batch])
    assert max(abs(a - b) for s, row, out in zip(batch, policy, staged)
               for a, b in zip(row[len(s.prompt_ids) - 1:].tolist(), out)) < 1e-5

    assert trainer.train_step(batch)["loss/kl"] < 1e-10  # step 0's KL, in the loss
    frozen = {n: p for n, p in module.named_parameters() if ".reference." in n}
    assert frozen and not any(p.requires_grad or p.grad is not None for p in frozen.values())
    optimized = {id(p) for group in trainer.engine.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in frozen.values()}
    from peft import get_peft_model_state_dict

    kept = get_peft_model_state_dict(module, adapter_name="reference")
    assert set(kept) == set(init) and all(torch.equal(kept[k], init[k]) for k in init)  # it did not move
    with torch.no_grad():
        moved, _ = trainer._logprobs(module, ids, att)
    after, _ = trainer._reference_logprobs(ids, att)
    assert torch.allclose(after, ref, atol=1e-6) and not torch.allclose(moved[mask], after[mask], atol=1e-4)

    sent = trainer.state_dict()
    assert set(sent) == set(init) and any(not torch.equal(sent[k], init[k]) for k in init)  # the policy's own
    assert set(load_file(trainer_weight_file(trainer, str(tmp_path), 1).path)) == set(init)
    trainer.save(str(tmp_path / "model"))
    saved = tmp_path / "model" / "adapter"
    assert not [p.name for p in saved.iterdir() if p.is_dir()]  # PEFT puts a second adapter in a folder of its name
    on_disk = load_file(str(saved / "adapter_model.safetensors"))
    assert set(on_disk) == set(init) and all(torch.equal(on_disk[k], sent[k]) for k in init)
