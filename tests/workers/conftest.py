"""Fixtures shared by the engine tests."""
import asyncio

import pytest


@pytest.fixture(autouse=True)
def templates_compile_in_process(monkeypatch):
    """The engine compiles prompt templates itself; a Django process (pytest-django sets one
    up in this session) hands them to a bounded child instead (fluxrl/runs/apps.py)."""
    from workers.tasks import prompts

    monkeypatch.setattr(prompts, "_template_checker", None)


@pytest.fixture(scope="module")
def loop():
    """One event loop per module, for an engine started once and used by every test in it."""
    loop = asyncio.new_event_loop()
    yield loop
    pending = asyncio.all_tasks(loop)
    for task in pending:  # the engine's output handler outlives its shutdown
        task.cancel()
    if pending:  # (gather of nothing would belong to another loop)
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


@pytest.fixture(scope="module")
def engine(loop, tiny_model_path):
    """A warm vLLM engine on the tiny model (keep updates), for the module."""
    from workers.rollout.engine import RolloutEngine
    from workers.rollout.engine_args import configure_cpu_environment

    configure_cpu_environment(None, 1.0)
    eng = RolloutEngine(tiny_model_path, update_mode="keep", max_model_len=256)
    loop.run_until_complete(eng.start())
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    """The tiny model in Hugging Face transformers: the reference the engines must match."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path)

