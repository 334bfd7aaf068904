"""The rules between a run spec's sections (workers/spec/rules.py): each rule refuses a spec
that breaks it, a group names every rule it breaks in one message, and the first group in
the table's order refuses."""
import pytest

from workers.spec import RULES, SpecError, validate_spec
from workers.spec.rules import refusal

BASE = {"name": "t", "model": {"path": "m"}, "task": {"dataset": "gen:add"}}
LORA = {"model": {"path": "m", "lora": {"rank": 8}}}
SHARED = {**LORA, "rollout": {"share_engines": True}}
PIPELINE = {"trainer": {"pipeline": {"stages": 2}}, "algorithm": {"advantage": "gae"}}
STREAM = {"schedule": {"mode": "sync", "stream_train": True}}


def spec(*changes: dict) -> dict:
    """BASE with each change's sections merged in, field by field."""
    out = dict(BASE)
    for change in changes:
        for section, values in change.items():
            out[section] = {**out[section], **values} if isinstance(out.get(section), dict) else values
    return out


# (a spec, the group that refuses it, the indices of the group's rules it breaks); every rule
# of the table is here at least once
CASES = [
    (spec({"rollout": {"gather_tail": 2, "migrate_tail": 2}}), "rollout.gather_tail", [0]),
    (spec({"schedule": {"mode": "async", "stream_train": True}}), "schedule.stream_train", [0]),
    (spec(STREAM, {"algorithm": {"minibatches": 2}}), "schedule.stream_train", [1]),
    (spec(STREAM, {"algorithm": {"advantage": "gae"}, "trainer": {"zero_stage": 1}}), "schedule.stream_train", [2]),
    (spec(STREAM, {"algorithm": {"advantage": "gae"}, "model": {"path": "m", "dtype": "float16"}}),
     "schedule.stream_train", [2]),
    (spec({"schedule": {"mode": "sync"}, "algorithm": {"drop_uniform_groups": True}}),
     "algorithm.drop_uniform_groups", [0]),
    (spec({"algorithm": {"drop_uniform_groups": True, "group_size": 1}}), "algorithm.drop_uniform_groups", [1]),
    (spec({"trainer": {"pipeline": {"stages": 2}}}), "trainer.pipeline.stages", [0]),
    (spec(PIPELINE, {"trainer": {"zero_stage": 1}}), "trainer.pipeline.stages", [1]),
    (spec(PIPELINE, {"critic": {"zero_stage": 2}}), "trainer.pipeline.stages", [1]),
    (spec(PIPELINE, {"model": {"path": "m", "dtype": "bfloat16"}}), "trainer.pipeline.stages", [2]),
    (spec(PIPELINE, {"algorithm": {"ppo_epochs": 2}}), "trainer.pipeline.stages", [3]),
    (spec(PIPELINE, STREAM), "trainer.pipeline.stages", [4]),
    (spec(PIPELINE, {"algorithm": {"kl_coef": 0.1}}), "trainer.pipeline.stages", [5]),
    (spec(PIPELINE, {"resources": {"trainer_ranks": 2}}), "trainer.pipeline.stages", [6]),
    (spec(LORA, PIPELINE), "model.lora", [0, 2]),  # a pipeline needs gae, which LoRA refuses
    (spec(LORA, {"trainer": {"zero_stage": 3}}), "model.lora", [1]),
    (spec(LORA, {"algorithm": {"advantage": "gae"}}), "model.lora", [2]),
    (spec(LORA, {"rollout": {"weight_transport": "collective"}}), "model.lora", [3]),
    (spec(LORA, {"resources": {"colocate": True}}), "model.lora", [4]),
    (spec({"rollout": {"share_engines": True}}), "rollout.share_engines", [0]),
    (spec(SHARED, {"rollout": {"update_mode": "drain"}}), "rollout.share_engines", [1]),
    (spec(SHARED, {"resources": {"nodes": 2}}), "rollout.share_engines", [2]),
    (spec(SHARED, {"resources": {"engine_processes": False}}), "rollout.share_engines", [3]),
    (spec(SHARED, {"schedule": {"dispatch": "skew_aware"}}), "rollout.share_engines", [4]),
    (spec(SHARED, {"rollout": {"max_num_seqs": 4}}), "rollout.share_engines", [5]),
    (spec({"algorithm": {"advantage": "gae"}, "resources": {"nodes": 2}}), "algorithm.advantage", [0]),
    (spec({"critic": {"forward": "stage"}}), "critic.forward", [0]),
    (spec({"algorithm": {"kl_reference": "stage"}}), "algorithm.kl_reference", [0]),
    (spec({"task": {"eval_size": 0}, "eval": {"sets": [{"name": "b"}]}}), "eval.sets", [0]),
]


def refused(doc: dict) -> str:
    with pytest.raises(SpecError) as err:
        validate_spec(doc)
    [error] = err.value.errors
    assert error["field"] == "(document)"
    return error["message"].removeprefix("Value error, ")


def test_every_rule_of_the_table_has_a_spec_that_breaks_it():
    covered = {(asks, i) for _, asks, broken in CASES for i in broken}
    every = {(group.asks, i) for group in RULES for i in range(len(group.rules))}
    assert every - covered == set()


@pytest.mark.parametrize("doc, asks, broken", CASES, ids=[f"{c[1]}-{c[2]}" for c in CASES])
def test_a_spec_is_refused_naming_each_rule_of_the_group_it_breaks(doc, asks, broken, monkeypatch):
    message = refused(doc)
    with monkeypatch.context() as patched:  # the same spec with its sections validated, the rules not applied
        patched.setattr("workers.spec.run.refusal", lambda spec: None)
        checked = validate_spec(doc)
    group = next(g for g in RULES if g.asks == asks)
    assert [i for i, rule in enumerate(group.rules) if rule.broken(checked)] == broken
    needs = [group.rules[i].message(checked) for i in broken]
    assert message == (group.lead + "; ".join(needs) if group.lead else needs[0])


def test_a_group_with_a_lead_names_every_broken_rule_in_one_message():
    message = refused(spec(LORA, {"trainer": {"zero_stage": 3}, "resources": {"colocate": True}}))
    assert message == ("model.lora needs trainer.zero_stage 0, 1 or 2 (ZeRO-3 would shard a frozen base model that "
                       "every rank needs whole for its forward: nothing to gain, not supported); resources.colocate "
                       "false (not supported with LoRA yet)")


def test_a_rule_quoting_the_spec_names_its_values():
    assert refused(spec(SHARED, {"algorithm": {"group_size": 16}, "rollout": {"max_num_seqs": 8}})) == (
        "rollout.share_engines needs algorithm.group_size at most rollout.max_num_seqs (16 > 8: the pool's engine "
        "has that many seats, shared with the other runs)")
    sets = [{"name": "a", "dataset": "gen:add"}, {"name": "b"}, {"name": "c"}]
    assert refused(spec({"task": {"eval_size": 0}, "eval": {"sets": sets}})) == (
        "eval.sets.1 (b) has no dataset, so it evaluates the run's held-out split, but task.eval_size is 0: give the "
        "set a dataset, or hold rows out")


def test_the_first_group_in_the_table_refuses_a_spec_that_breaks_two():
    doc = spec(SHARED, {"trainer": {"zero_stage": 3}, "rollout": {"update_mode": "drain"}})
    assert refused(doc).startswith("model.lora needs trainer.zero_stage 0, 1 or 2")
    assert [g.asks for g in RULES].index("model.lora") < [g.asks for g in RULES].index("rollout.share_engines")


def test_defaults_from_other_sections_are_filled_in_before_the_rules_read_them():
    piped = validate_spec(spec(PIPELINE))  # minibatches left out: 1 for a pipeline, so its rule holds
    assert piped.algorithm.minibatches == 1 and refusal(piped) is None
    assert validate_spec(spec(STREAM)).algorithm.minibatches == 1
    assert validate_spec(spec({"algorithm": {"loss": "ppo"}})).algorithm.minibatches == 2
