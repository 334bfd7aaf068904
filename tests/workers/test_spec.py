from pathlib import Path

import pytest

from workers.spec import SpecError, validate_spec

GOOD = {"name": "t", "model": {"path": "m"}, "task": {"dataset": "gen:add"}}


def test_minimal_spec_gets_documented_defaults():
    spec = validate_spec(GOOD)
    assert spec.schedule.mode == "async" and spec.schedule.max_staleness == 2
    assert spec.rollout.update_mode == "keep" and spec.algorithm.loss == "ppo"


def test_ppo_takes_two_minibatches_unless_told_and_reinforce_or_stream_training_one():
    assert validate_spec(GOOD).algorithm.minibatches == 2  # decoupled PPO's clip binds from the second
    assert validate_spec({**GOOD, "algorithm": {"loss": "reinforce"}}).algorithm.minibatches == 1
    streamed = {**GOOD, "schedule": {"mode": "sync", "stream_train": True}, "trainer": {"zero_stage": 0}}
    assert validate_spec(streamed).algorithm.minibatches == 1
    assert validate_spec({**GOOD, "algorithm": {"minibatches": 1}}).algorithm.minibatches == 1
    with pytest.raises(SpecError, match="minibatches and ppo_epochs must be 1"):
        validate_spec({**streamed, "algorithm": {"minibatches": 2}})
    resolved = validate_spec(GOOD).to_dict()  # a stored spec says what ran
    assert resolved["algorithm"]["minibatches"] == 2 and validate_spec(resolved).algorithm.minibatches == 2


def test_unknown_field_is_rejected_by_name():
    with pytest.raises(SpecError) as err:
        validate_spec({**GOOD, "schedule": {"mode": "async", "max_stalenes": 3}})
    assert err.value.errors == [{"field": "schedule.max_stalenes", "message": "unknown field"}]


def test_wrong_type_names_the_field():
    with pytest.raises(SpecError) as err:
        validate_spec({**GOOD, "algorithm": {"group_size": "eight"}})
    assert err.value.errors[0]["field"] == "algorithm.group_size"


def test_bad_enum_and_missing_section_are_both_reported():
    with pytest.raises(SpecError) as err:
        validate_spec({"name": "t", "model": {"path": "m"}, "rollout": {"update_mode": "sometimes"}})
    fields = {e["field"] for e in err.value.errors}
    assert fields == {"task", "rollout.update_mode"}


def test_user_reward_needs_code():
    with pytest.raises(SpecError, match="reward.code"):
        validate_spec({**GOOD, "reward": {"function": "user"}})


def test_yaml_text_is_accepted_and_garbage_is_not():
    assert validate_spec("name: t\nmodel: {path: m}\ntask: {dataset: x.jsonl}\n").task.dataset == "x.jsonl"
    with pytest.raises(SpecError, match="mapping"):
        validate_spec("- just\n- a list\n")


def test_the_cli_only_examples_are_valid_specs():
    from workers.spec import load_spec_file

    folder = Path(__file__).resolve().parents[2] / "examples" / "own-model"
    examples = sorted(folder.glob("*.yaml"))
    assert examples
    for example in examples:
        assert load_spec_file(str(example)).task.dataset.endswith(".jsonl")


@pytest.mark.parametrize("example", sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_example_spec_is_valid(example):
    assert validate_spec(example.read_text()).name


def test_model_dtype_auto_is_float32_on_the_cpu_bfloat16_for_a_gpu_plan_and_an_explicit_one_is_kept():
    from workers.spec import model_dtype

    auto = validate_spec({"name": "t", "model": {"path": "m"}, "task": {"dataset": "gen:add"}})
    assert auto.model.dtype == "auto"
    import torch

    assert model_dtype(auto) == ("bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported()
                                 else "float32")
    assert (model_dtype(auto, on_gpu=True), model_dtype(auto, on_gpu=False)) == ("bfloat16", "float32")
    fp16 = validate_spec({"name": "t", "model": {"path": "m", "dtype": "float16"}, "task": {"dataset": "gen:add"}})
    assert model_dtype(fp16, on_gpu=False) == model_dtype(fp16) == "float16"
