"""model.lora in the real engine (vLLM on the CPU, PunicaWrapperCPU): the adapter is served as
a vLLM LoRA, loaded again in place at each version. An in-flight (keep) update switches the
running sequences to the new adapter from their next token, per-token versions stay exact,
and an interrupt update resumes each sequence from its prefix under the new adapter.

In the keep test the adapters act on the last layer's q_proj and o_proj only (the other
layers' B = 0), so the KV cache a sequence keeps across the update (every layer's K and V
are computed before that layer's q_proj) does not depend on the adapter: each token's
behaviour log-prob must then be exactly the one the adapter of its version computes over
the whole sequence."""
import asyncio

import pytest

from tests.workers.rollout.lora_adapters import RANK
from tests.workers.rollout.lora_adapters import adapter_file as _file
from tests.workers.rollout.lora_adapters import model_logprobs as _model_logprobs
from tests.workers.rollout.lora_adapters import seeded_adapter as _adapter
from workers.models.tinymodel import encode
from workers.rollout.engine import RolloutEngine
from workers.weights.sync import tensors_checksum

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


async def _gap(engine, model, prompt="12+34="):
    comp = await engine.generate(encode(prompt), max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    return max(abs(a - b) for a, b in zip(_model_logprobs(model, comp), comp.logprobs))


async def _run_with_update(engine, weights, version, n=6, max_tokens=100):
    tasks = [asyncio.create_task(engine.generate(encode(f"{i}+{i}="), max_tokens, 1.0, ignore_eos=True))
             for i in range(n)]
    start = engine.generated_tokens
    while engine.generated_tokens < start + 20 * n:  # every request under way with the old adapter
        await asyncio.sleep(0.02)
    timing = await engine.update_weights(weights, version)
    return await asyncio.gather(*tasks), timing


@pytest.fixture(scope="module")
def lora_engine(loop, tiny_model_path, tmp_path_factory):
    from workers.rollout.engine_args import configure_cpu_environment

    configure_cpu_environment(None, 1.0)
    eng = RolloutEngine(tiny_model_path, update_mode="keep", max_model_len=256, lora_rank=RANK)
    loop.run_until_complete(eng.start())
    first, _ = _file(_adapter(tiny_model_path, None), tmp_path_factory.mktemp("adapters"), 0)
    loop.run_until_complete(eng.update_weights(first, 0))  # the trainer's fresh adapter: B = 0
    yield eng
    eng.shutdown()


def test_engine_args_enable_lora_at_a_rank_vllm_accepts(tiny_model_path):
    args = RolloutEngine(tiny_model_path, lora_rank=4).engine_args(on_cpu=True)
    assert args.enable_lora and args.max_lora_rank == 8 and args.max_loras == 1
    assert not RolloutEngine(tiny_model_path).engine_args(on_cpu=True).enable_lora


def test_the_adapter_is_served_as_a_lora_and_loaded_again_at_each_version(loop, lora_engine, tiny_model_path,
                                                                          hf_model, tmp_path):
    assert lora_engine.lora_request is not None
    assert loop.run_until_complete(_gap(lora_engine, hf_model)) < 1e-3  # B = 0: the base model exactly
    for version, seed in ((1, 1), (2, 2)):
        model = _adapter(tiny_model_path, seed)
        weights, state = _file(model, tmp_path, version)
        timing = loop.run_until_complete(lora_engine.update_weights(weights, version))
        assert timing.load_ms > 0
        assert loop.run_until_complete(_gap(lora_engine, model)) < 1e-3  # this version's adapter, exactly
        assert loop.run_until_complete(_gap(lora_engine, hf_model)) > 1e-2  # not the base model
        assert loop.run_until_complete(lora_engine.weights_checksum()) == tensors_checksum(state)


def test_a_keep_update_switches_running_sequences_to_the_new_adapter_from_the_next_token(
        loop, lora_engine, tiny_model_path, tmp_path):
    old_version = lora_engine.version
    old = _adapter(tiny_model_path, 10, scale=5.0, only_layer=2)
    loop.run_until_complete(lora_engine.update_weights(_file(old, tmp_path, old_version + 1)[0], old_version + 1))
    new = _adapter(tiny_model_path, 11, scale=5.0, only_layer=2)
    version = old_version + 2
    comps, timing = loop.run_until_complete(_run_with_update(lora_engine, _file(new, tmp_path, version)[0], version))
    assert all(c.length == 100 and c.versions.tokens == 100 for c in comps)
    spanning = [c for c in comps if [v for v, _ in c.versions.runs] == [version - 1, version]]
    assert spanning, [c.versions.runs for c in comps]
    differ = 0.0
    for c in spanning:
        labels = c.versions.per_token()
        old_lp, new_lp = _model_logprobs(old, c), _model_logprobs(new, c)
        for i, (lp, v) in enumerate(zip(c.logprobs, labels)):
            expected = old_lp[i] if v == version - 1 else new_lp[i]
            assert abs(lp - expected) < 1e-3, (i, v, lp, old_lp[i], new_lp[i])
            if v == version:
                differ = max(differ, abs(old_lp[i] - new_lp[i]))
    assert differ > 1e-2  # the two adapters do tell tokens after the update apart


def test_an_interrupt_update_resumes_each_sequence_from_its_prefix_under_the_new_adapter(
        loop, lora_engine, tiny_model_path, tmp_path):
    version = lora_engine.version + 1
    new = _adapter(tiny_model_path, 20)
    lora_engine.update_mode = "interrupt"
    try:
        comps, _ = loop.run_until_complete(_run_with_update(lora_engine, _file(new, tmp_path, version)[0], version,
                                                            max_tokens=120))
    finally:
        lora_engine.update_mode = "keep"
    assert all(c.length == 120 and len(c.logprobs) == 120 for c in comps)  # the budget is kept
    resumed = [c for c in comps if c.resubmits >= 1]
    assert resumed
    for c in resumed:  # the prefix under the old adapter, the rest recomputed under the new one
        assert [v for v, _ in c.versions.runs] == [version - 1, version]
        labels, new_lp = c.versions.per_token(), _model_logprobs(new, c)
        tail = [i for i, v in enumerate(labels) if v == version]
        assert max(abs(c.logprobs[i] - new_lp[i]) for i in tail) < 1e-3


def test_a_drain_update_lets_running_sequences_finish_under_the_old_adapter(loop, lora_engine, tiny_model_path,
                                                                            tmp_path):
    """update_mode drain with LoRA: the update waits for the running sequences, which finish
    whole under the old adapter's version; the next request generates with the new one."""
    old = _adapter(tiny_model_path, 30)
    version = lora_engine.version + 1
    loop.run_until_complete(lora_engine.update_weights(_file(old, tmp_path, version)[0], version))
    new = _adapter(tiny_model_path, 31)
    lora_engine.update_mode = "drain"
    try:
        comps, _ = loop.run_until_complete(_run_with_update(lora_engine, _file(new, tmp_path, version + 1)[0],
                                                            version + 1, n=4, max_tokens=60))
    finally:
        lora_engine.update_mode = "keep"
    for c in comps:
        assert c.length == 60 and [v for v, _ in c.versions.runs] == [version]
        assert max(abs(a - b) for a, b in zip(_model_logprobs(old, c), c.logprobs)) < 1e-3
    assert loop.run_until_complete(_gap(lora_engine, new)) < 1e-3
