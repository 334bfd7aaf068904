"""Weights over a torch.distributed collective (rollout.weight_transport: collective):
the trainer's broadcast lands in the real engine exactly (checksum, log-probs, greedy
tokens), in-flight updates keep their semantics, and a dead member fails the broadcast
in seconds instead of hanging it. The first test needs no engine: the group itself,
between two processes."""
import asyncio
import datetime
import logging
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from tests.workers.helpers import perturb

from workers.rollout.engine import RolloutEngine
from workers.models.tinymodel import encode
from workers.weights.broadcast import WeightBroadcaster
from workers.weights.weight_group import WeightBroadcastError, WeightGroup, bucket_layout, describe_state_dict
from workers.weights.sync import tensors_checksum


def _odd_state():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(50, 16, generator=g)
    return {"emb": emb, "w_t": torch.randn(16, 16, generator=g).t(),
            "half": torch.randn(3, generator=g).to(torch.bfloat16), "empty": torch.zeros(0, 4), "head": emb,
            "big": torch.randn(300, 1000, generator=g)}


def _receive_in_child(port, queue):
    group = WeightGroup("127.0.0.1", port, 1, 2, "gloo", 10.0)
    meta, _ = describe_state_dict(_odd_state(), 3, 64 * 1024)
    got = group.receive(meta)
    queue.put((list(got), tensors_checksum(got), got["head"] is got["emb"], got["w_t"].tolist()))
    group.close()


@pytest.mark.timeout(120)
def test_a_state_dict_crosses_the_group_exactly_in_packed_buckets():
    import torch.distributed as dist

    state = _odd_state()
    meta, sources = describe_state_dict(state, 3, 64 * 1024)
    assert [e[3] for e in meta["tensors"]] == [None, None, None, None, "emb", None]  # the tie is sent once
    assert len(bucket_layout(meta)) == 2  # the small ones packed together, the big one alone
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_receive_in_child, args=(store.port, queue))
    child.start()
    try:
        group = WeightGroup("127.0.0.1", store.port, 0, 2, "gloo", 10.0, store=store)
        group.send(meta, sources, lambda: False)
        names, checksum, tied, w_t = queue.get(timeout=60)
    finally:
        child.join(30)
    assert names == list(state) and checksum == tensors_checksum(state) and tied
    assert w_t == state["w_t"].tolist()  # a non-contiguous tensor arrives as its values
    group.close()


MB = 2**20


def _big_state() -> dict[str, torch.Tensor]:
    """100M float32 parameters (400 MB) in 50 tensors of 8 MB."""
    return {f"layer{i}.weight": torch.full((2048, 1024), float(i)) for i in range(50)}


def _peak_rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def _rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _load_in_child(port, bucket_bytes, streamed, queue):
    """An engine's side of an update: parameters already in memory (the steady state),
    the update copied into them. Reports the peak resident memory above the steady state."""
    from workers.weights.sync import combine_digests, tensor_digest

    params = {name: torch.zeros_like(t) for name, t in _big_state().items()}
    group = WeightGroup("127.0.0.1", port, 1, 2, "gloo", 60.0)
    meta, _ = describe_state_dict(params, 1, bucket_bytes)  # the names, dtypes and shapes the update has
    steady = _rss_mb()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    digests = {}
    items = group.receive_stream(meta) if streamed else group.receive(meta).items()
    for name, tensor in items:
        digests[name] = tensor_digest(tensor)
        params[name].copy_(tensor)
        del tensor
    items = None
    queue.put((_peak_rss_mb() - steady, combine_digests(digests), tensors_checksum(params)))
    group.close()


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("streamed", [True, False])
def test_an_update_streamed_bucket_by_bucket_holds_two_buckets_not_a_copy_of_the_model(streamed):
    import torch.distributed as dist

    state = _big_state()
    bucket = 32 * MB
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_load_in_child, args=(store.port, bucket, streamed, queue))
    child.start()
    try:
        group = WeightGroup("127.0.0.1", store.port, 0, 2, "gloo", 60.0, store=store)
        meta, sources = describe_state_dict(state, 1, bucket)
        group.send(meta, sources, lambda: False)
        above_mb, received, loaded = queue.get(timeout=120)
    finally:
        child.join(30)
        group.close()
    expected = tensors_checksum(state)
    assert received == loaded == expected  # the digests taken on the way are the state's checksum
    if streamed:  # the bucket being loaded and the next one arriving, plus allocator slack
        assert above_mb <= 2 * bucket / MB + 24, above_mb
    else:  # the same measure sees a whole copy when everything is received first
        assert above_mb >= 380, above_mb


class _WorkDoneAsTheSliceEnds:
    """A collective that completes while a sliced wait times out, as torch's ``Work.wait``
    then reports it: "Operation timed out!", and ``is_completed()`` already true. No real
    gloo collective can be made to hit that instant, so this stands in for one; ``error``:
    the operation itself failed instead."""

    def __init__(self, error=None):
        self.error, self.done = error, False

    def wait(self, timeout):
        if not self.done:
            self.done = True
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self):
        return self.done


def _bare_group():
    group = WeightGroup.__new__(WeightGroup)
    group.rank, group.timeout_s = 1, 5.0
    return group


def test_a_collective_finishing_as_a_wait_slice_ends_counts_as_done_and_a_failed_one_still_fails():
    _bare_group()._wait(_WorkDoneAsTheSliceEnds(), lambda: False)  # no error: it finished
    with pytest.raises(WeightBroadcastError, match="failed on rank 1: Connection closed by peer"):
        _bare_group()._wait(_WorkDoneAsTheSliceEnds(error="Connection closed by peer"), lambda: False)


# -- the real engine ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def broadcaster(loop, engine):
    b = WeightBroadcaster(timeout_s=30)
    loop.run_until_complete(b.open([engine]))
    yield b
    b.close()


def _model_logprobs(model, comp):
    with torch.no_grad():
        logits = model(torch.tensor([comp.prompt_ids + comp.token_ids])).logits[0].float().log_softmax(-1)
    n = len(comp.prompt_ids)
    return logits, [logits[n - 1 + i, t].item() for i, t in enumerate(comp.token_ids)]


async def _follows(engine, model):
    """Max |engine log-prob − HF log-prob| over a sampled completion, and whether a greedy
    completion is the model's argmax at every step."""
    sampled = await engine.generate(encode("12+34="), max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    gap = max(abs(a - b) for a, b in zip(_model_logprobs(model, sampled)[1], sampled.logprobs))
    greedy = await engine.generate(encode("56+7="), max_tokens=12, temperature=0.0, ignore_eos=True)
    logits, _ = _model_logprobs(model, greedy)
    n = len(greedy.prompt_ids)
    return gap, all(logits[n - 1 + i].argmax().item() == t for i, t in enumerate(greedy.token_ids))


@pytest.mark.parametrize("seed", [1, 2])  # the first load is vLLM's reload, later ones copy in place
@pytest.mark.engine
@pytest.mark.timeout(600)
def test_the_engine_holds_exactly_the_broadcast_weights(loop, engine, broadcaster, hf_model, seed):
    state = perturb(hf_model, seed=seed)
    version = engine.version + 1
    [timing] = loop.run_until_complete(broadcaster.broadcast(state, version))
    assert timing.version == version == engine.version and timing.load_ms > 0
    assert loop.run_until_complete(engine.weights_checksum()) == tensors_checksum(state)
    gap, greedy_is_argmax = loop.run_until_complete(_follows(engine, hf_model))
    assert gap < 1e-3 and greedy_is_argmax


async def _run_with_broadcast(engine, broadcaster, state, version, n=12, max_tokens=120):
    tasks = [asyncio.create_task(engine.generate(encode(f"{i}+{i}="), max_tokens, 1.0, ignore_eos=True))
             for i in range(n)]
    start = engine.generated_tokens
    while engine.generated_tokens < start + 20 * n:  # every request going under the old weights
        await asyncio.sleep(0.02)
    await broadcaster.broadcast(state, version)
    return await asyncio.gather(*tasks)


@pytest.mark.parametrize("mode", ["keep", "interrupt", "drain"])
@pytest.mark.engine
@pytest.mark.timeout(600)
def test_in_flight_updates_through_the_collective_keep_their_semantics(loop, engine, broadcaster, hf_model, mode):
    engine.update_mode = mode
    try:
        old = engine.version
        state = perturb(hf_model, scale=0.02, seed=10 + len(mode))
        completions = loop.run_until_complete(_run_with_broadcast(engine, broadcaster, state, old + 1))
    finally:
        engine.update_mode = "keep"
    assert all(c.length == 120 and len(c.logprobs) == 120 and c.versions.tokens == 120 for c in completions)
    runs = [[v for v, _ in c.versions.runs] for c in completions]
    if mode == "drain":  # requests finish before the load
        assert all(r == [old] for r in runs), runs
    else:  # running requests span both versions: kept (keep) or resumed from their prefix (interrupt)
        assert any(r == [old, old + 1] for r in runs), runs
        assert all(r in ([old], [old, old + 1]) for r in runs), runs
    if mode == "interrupt":
        assert any(c.resubmits >= 1 for c in completions)
    assert engine.version == old + 1
    assert loop.run_until_complete(engine.weights_checksum()) == tensors_checksum(state)
    gap, _ = loop.run_until_complete(_follows(engine, hf_model))
    assert gap < 1e-3


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_a_dead_member_fails_the_broadcast_in_seconds_and_the_group_reforms(loop, engine, broadcaster, hf_model,
                                                                           tiny_model_path):
    victim = RolloutEngine(tiny_model_path, index=1, update_mode="keep", max_model_len=256)
    loop.run_until_complete(victim.start())
    group = WeightBroadcaster(timeout_s=30)  # a timeout far above the seconds allowed below
    try:
        loop.run_until_complete(group.open([engine, victim]))
        state = perturb(hf_model, scale=0.02, seed=20)
        version = engine.version + 1
        loop.run_until_complete(group.broadcast(state, version))
        checksum = tensors_checksum(state)
        assert [loop.run_until_complete(e.weights_checksum()) for e in (engine, victim)] == [checksum, checksum]

        os.kill(victim.core_pids()[0], signal.SIGKILL)
        time.sleep(0.5)
        new = perturb(hf_model, scale=0.02, seed=21)
        t0 = time.monotonic()
        with pytest.raises(WeightBroadcastError, match="rollout engine") as failure:
            loop.run_until_complete(group.broadcast(new, version + 1))
        elapsed = time.monotonic() - t0
        logging.getLogger(__name__).info("broadcast to a dead member failed in %.2f s: %s", elapsed, failure.value)
        assert elapsed < 5, (elapsed, str(failure.value))
        # the survivor's receive was aborted: old weights, old label, still serving
        assert engine.version == version
        assert loop.run_until_complete(engine.weights_checksum()) == checksum
        assert loop.run_until_complete(engine.generate(encode("1+2="), 4, 1.0, ignore_eos=True)).length == 4

        # formed again with the live engine only, the same update goes through
        loop.run_until_complete(group.open([engine]))
        loop.run_until_complete(group.broadcast(new, version + 1))
        assert engine.version == version + 1
        assert loop.run_until_complete(engine.weights_checksum()) == tensors_checksum(new)
    finally:
        group.close()
        victim.shutdown()
        loop.run_until_complete(broadcaster.open([engine]))  # the module's group, for any later test
