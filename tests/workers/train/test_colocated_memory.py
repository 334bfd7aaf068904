"""Colocated plans: after each optimizer step the trainer hands its caching allocator's
free blocks back to the driver, so the engines that wake into the same GPU find them
(vLLM's wake failed on memory the trainer's allocator still cached). Elsewhere
the cache is kept (emptying it costs the next step its allocations)."""
from types import SimpleNamespace

import pytest
import torch

from workers.spec import validate_spec
from workers.train.trainer import Trainer


def bare_trainer(colocate: bool) -> Trainer:
    spec = validate_spec({"name": "t", "model": {"path": "m"}, "task": {"dataset": "gen:add"}})
    spec = spec.model_copy(update={"resources": spec.resources.model_copy(update={"colocate": colocate})})
    trainer = object.__new__(Trainer)  # the step's bookkeeping only: no DeepSpeed engine
    steps = []
    trainer.spec, trainer.critic, trainer._acc = spec, None, {"loss": 0.0, "optimizer_s": 0.0}
    trainer.engine = SimpleNamespace(step=lambda: steps.append("policy"))
    return trainer, steps


@pytest.mark.parametrize("colocate, emptied", [(True, 1), (False, 0)])
def test_a_colocated_trainer_empties_the_cuda_cache_after_each_optimizer_step(colocate, emptied, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    trainer, steps = bare_trainer(colocate)
    assert trainer._optimizer_step() is trainer._acc and trainer._acc["optimizer_s"] >= 0.0
    assert steps == ["policy"] and len(calls) == emptied


def test_without_a_gpu_nothing_is_emptied(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    trainer, _ = bare_trainer(True)
    trainer._optimizer_step()
    assert calls == []
