"""Every trainer and rollout engine offers what its Protocol in workers/api.py declares:
each method exists with the Protocol's parameters (names and kinds, in order; any
parameter of its own after them has a default), async where the Protocol's is, and each
property is a property or an attribute the class sets. A method that drifts (renamed,
reordered, a parameter added without a default, sync made async) fails here, as it would
fail its callers."""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Optional, Protocol

import pytest

from workers import api
from workers.agents.api import Environment
from workers.weights.files import WeightWriter


def _classes():
    from workers.cluster.node import ClusterTrainer
    from workers.rollout.client import EngineClient
    from workers.rollout.engine import RolloutEngine
    from workers.rollout.pool import TenantEngine
    from workers.rollout.pool_client import PoolClient
    from workers.train.pipeline_trainer import PipelineTrainer
    from workers.train.ranks import TrainerGroup
    from workers.train.trainer import Trainer

    return {c.__name__: c for c in (ClusterTrainer, EngineClient, RolloutEngine, PoolClient, TenantEngine,
                                    PipelineTrainer, TrainerGroup, Trainer)}


# (Protocol, the implementations that must satisfy it): the same table as workers/api.py's
# assignments for mypy
CONTRACTS = [
    (api.TrainEngine, ["Trainer", "TrainerGroup", "PipelineTrainer", "ClusterTrainer"]),
    (api.StreamTrainEngine, ["Trainer", "TrainerGroup", "ClusterTrainer"]),
    (api.CriticTrainEngine, ["Trainer", "TrainerGroup", "PipelineTrainer"]),
    (api.WeightGroupHost, ["TrainerGroup", "ClusterTrainer"]),
    (api.TrainerProcesses, ["TrainerGroup", "PipelineTrainer", "ClusterTrainer"]),
    (WeightWriter, ["Trainer", "TrainerGroup", "PipelineTrainer", "ClusterTrainer"]),
    (api.InferenceEngine, ["RolloutEngine", "EngineClient", "TenantEngine", "PoolClient"]),
]


def protocol_members(proto: type) -> dict[str, object]:
    """The members a Protocol declares, its Protocol bases' included: name -> the function,
    the property, or None for a bare annotation."""
    members: dict[str, object] = {}
    for cls in reversed(proto.__mro__):
        if cls in (object, Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        for name in getattr(cls, "__annotations__", {}):
            members.setdefault(name, None)
        for name, value in vars(cls).items():
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
                members[name] = value
    return members


def assigned_attributes(cls: type) -> set[str]:
    """Names a class or its bases assign as ``self.<name> = ...`` (or annotate) in any method."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return names


PLAIN, COROUTINE, ASYNC_GENERATOR = "a plain function", "a coroutine function", "an async generator"


def _async_kind(fn) -> str:
    if inspect.isasyncgenfunction(fn):
        return ASYNC_GENERATOR
    return COROUTINE if inspect.iscoroutinefunction(fn) else PLAIN


def _expected_kind(fn) -> str:
    """A Protocol method declared ``def ... -> AsyncIterator[...]`` is an async generator."""
    returns = str(inspect.signature(fn).return_annotation)
    if _async_kind(fn) == PLAIN and returns.startswith("AsyncIterator"):
        return ASYNC_GENERATOR
    return _async_kind(fn)


def signature_drift(expected, actual) -> Optional[str]:
    """Why ``actual`` does not fit the Protocol method ``expected``; None when it does."""
    want = list(inspect.signature(expected).parameters.values())[1:]  # self
    have = list(inspect.signature(actual).parameters.values())[1:]
    if len(have) < len(want):
        return f"takes ({', '.join(p.name for p in have)}), the Protocol ({', '.join(p.name for p in want)})"
    for w, h in zip(want, have):
        if (w.name, w.kind) != (h.name, h.kind):
            return f"parameter {h.name!r} ({h.kind.description}) where the Protocol has {w.name!r} " \
                   f"({w.kind.description})"
        if w.default is not inspect.Parameter.empty and h.default is inspect.Parameter.empty:
            return f"parameter {h.name!r} has no default, the Protocol's has"
    for extra in have[len(want):]:
        if extra.default is inspect.Parameter.empty and extra.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                                           inspect.Parameter.VAR_KEYWORD):
            return f"parameter {extra.name!r} of its own has no default: the Protocol's callers do not pass it"
    if _expected_kind(expected) != _async_kind(actual):
        return f"is {_async_kind(actual)}, the Protocol's {_expected_kind(expected)}"
    return None


def contract_violations(proto: type, cls: type) -> list[str]:
    found = []
    attributes = None
    for name, declared in protocol_members(proto).items():
        held = inspect.getattr_static(cls, name, None)
        if inspect.isfunction(declared):
            if not inspect.isfunction(held):
                found.append(f"{cls.__name__}.{name}: missing (the Protocol's is a method)")
                continue
            why = signature_drift(declared, held)
            if why:
                found.append(f"{cls.__name__}.{name}: {why}")
            continue
        if held is not None and not inspect.isfunction(held):  # a property, or a class attribute
            continue
        attributes = assigned_attributes(cls) if attributes is None else attributes
        if name not in attributes:
            found.append(f"{cls.__name__}.{name}: missing (neither a property nor an attribute it sets)")
    return found


@pytest.mark.parametrize("proto,names", CONTRACTS, ids=[p.__name__ for p, _ in CONTRACTS])
def test_every_implementation_offers_its_protocol(proto, names):
    classes = _classes()
    problems = [v for name in names for v in contract_violations(proto, classes[name])]
    assert problems == []


def test_the_protocols_declare_what_callers_use():
    trainer = set(protocol_members(api.TrainEngine))
    assert {"version", "train_step", "state_dict", "save", "save_state", "load_state",
            "write_weight_file"} <= trainer
    assert {"begin_step", "accumulate", "finish_step"} <= set(protocol_members(api.StreamTrainEngine))
    engine = set(protocol_members(api.InferenceEngine))
    assert {"generate", "stream_group", "update_weights", "sleep", "wake_up", "shutdown", "dead",
            "version", "start", "hand_off"} <= engine
    assert api.Environment is Environment  # the agentic environment's contract is re-exported


class _Drifted:
    """A trainer whose methods drifted from TrainEngine each in one way."""
    version = 0

    def train_step(self, samples):  # renamed parameter
        return {}

    def state_dict(self, model):  # a parameter of its own without a default
        return None

    def save(self, path: str) -> None: ...

    async def save_state(self, folder: str) -> None: ...  # async where the Protocol's is not

    def load_state(self, folder: str) -> int:
        return 0


def test_the_check_finds_a_renamed_parameter_a_new_required_one_a_wrong_kind_and_a_missing_method():
    assert contract_violations(api.TrainEngine, _Drifted) == [
        "_Drifted.write_weight_file: missing (the Protocol's is a method)",
        "_Drifted.train_step: parameter 'samples' (positional or keyword) where the Protocol has 'batch' "
        "(positional or keyword)",
        "_Drifted.state_dict: parameter 'model' of its own has no default: the Protocol's callers do not pass it",
        "_Drifted.save_state: is a coroutine function, the Protocol's a plain function",
    ]


class _Engine:
    def __init__(self):
        self.index = 0

    def stream_group(self, prompt_ids, n, max_tokens, temperature, seed=None, ignore_eos=False, priority=0):
        return []  # not an async generator


def test_the_check_finds_a_missing_attribute_and_a_stream_that_is_not_async():
    problems = contract_violations(api.InferenceEngine, _Engine)
    assert "_Engine.stream_group: is a plain function, the Protocol's an async generator" in problems
    assert "_Engine.update_mode: missing (neither a property nor an attribute it sets)" in problems
    assert not any(p.startswith("_Engine.index") for p in problems)


# -- the factory ----------------------------------------------------------------------------------
def _spec(**sections):
    from workers.spec import validate_spec

    return validate_spec({"name": "contracts", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
                          **sections})


def _configs(spec, count=2):
    from workers.rollout.messages import EngineServerConfig

    return [EngineServerConfig(model_path=spec.model.path, index=i, update_mode="interrupt", seed=5 + i, top_p=0.9,
                               stop=["\n"], stop_token_ids=[2], max_num_seqs=16, lora_rank=8 if spec.model.lora
                               else None) for i in range(count)]


def test_make_engines_builds_in_process_engines_from_their_servers_configurations():
    from workers.rollout.engine import RolloutEngine

    spec = _spec()
    engines = api.make_engines(spec, _configs(spec), in_process=True)
    assert [type(e) for e in engines] == [RolloutEngine, RolloutEngine]
    assert [(e.index, e.seed, e.update_mode, e.max_num_seqs) for e in engines] == [(0, 5, "interrupt", 16),
                                                                                  (1, 6, "interrupt", 16)]
    assert engines[1].sampling.top_p == 0.9 and engines[1].sampling.stop == ("\n",)
    assert engines[1].sampling.stop_token_ids == (2,)
    assert all(e.engine is None for e in engines)  # nothing started


def test_make_engines_picks_servers_remote_ones_by_index_and_pool_places_for_shared_engines():
    from workers.rollout.client import EngineClient
    from workers.rollout.pool_client import PoolClient

    spec = _spec()
    servers = api.make_engines(spec, _configs(spec), in_process=False, remote={1: ("10.0.0.2:7000", 4242)})
    assert [type(e) for e in servers] == [EngineClient, EngineClient]
    assert (servers[0].address, servers[1].address, servers[1].server_pid) == (None, "10.0.0.2:7000", 4242)
    shared = _spec(model={"path": "builtin:tiny", "lora": {"rank": 8}}, rollout={"share_engines": True},
                   algorithm={"group_size": 4})
    places = api.make_engines(shared, _configs(shared), in_process=False)
    assert [type(e) for e in places] == [PoolClient, PoolClient]
    tenant = places[0].tenant
    assert (tenant.lora_rank, tenant.update_mode, tenant.top_p, tenant.stop_token_ids, tenant.group_size) == \
        (8, "interrupt", 0.9, [2], 4)


def test_make_trainer_refuses_what_it_cannot_build_here():
    from types import SimpleNamespace

    from workers.cluster.placement import PlacementError

    with pytest.raises(PlacementError, match="trainer.pipeline.stages > 1"):
        api.make_trainer(_spec(trainer={"pipeline": {"stages": 2}}, algorithm={"advantage": "gae"}),
                         SimpleNamespace(device="gpu"), 0)
    with pytest.raises(ValueError, match="several nodes"):
        api.make_trainer(_spec(resources={"nodes": 2}), SimpleNamespace(device="cpu"), 0)
