"""A rollout engine in its own process (workers/rollout/server.py), driven through
EngineClient: it generates what the in-process engine generates, takes weights by RPC
and through the collective (its barrier crosses the process boundary), refuses a
client without the run's key, and a killed server ends its pending calls within
moments and leaves no process behind; a server outlives neither its launcher nor its
deadline for a client to connect."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.workers.helpers import perturb
from workers.io import wire
from workers.rollout.client import EngineClient
from workers.rollout.messages import REPLIES, EngineServerConfig
from workers.rollout.engine_types import EngineDied
from workers.models.tinymodel import encode
from workers.weights.broadcast import WeightBroadcaster
from workers.weights.sync import serialize_state_dict, tensors_checksum
from workers.weights.update import InlineWeights

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[3]


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(loop, tiny_model_path):
    # vLLM inside the server, as the planner starts CPU engines (the drain test below has its engine core apart)
    client = EngineClient(EngineServerConfig(model_path=tiny_model_path, index=3, max_model_len=256,
                                             cpu_single_process=True))
    loop.run_until_complete(client.start())
    yield client
    client.shutdown()


def test_the_server_generates_what_the_in_process_engine_generates(loop, server, engine):
    prompts = [encode(f"{a}+{b}=") for a, b in [(12, 34), (5, 67), (80, 9)]]

    async def greedy(e):
        return await asyncio.gather(*(e.generate(p, 10, 0.0, ignore_eos=True) for p in prompts))

    here, there = loop.run_until_complete(greedy(engine)), loop.run_until_complete(greedy(server))
    assert [c.token_ids for c in there] == [c.token_ids for c in here]
    assert all(max(abs(a - b) for a, b in zip(x.logprobs, y.logprobs)) < 1e-4 for x, y in zip(here, there))
    assert all(c.engine == 3 and c.versions.runs == [[server.version, 10]] for c in there)
    assert server.generated_tokens >= 30 and server.busy_seconds() > 0 and not server.active


def test_a_group_request_on_the_server_samples_what_the_in_process_engine_samples(loop, server, engine):
    prompt = encode("23+45=")

    async def group(e):
        seen = []
        async for index, comp in e.stream_group(prompt, 6, 12, 1.0, seed=5):
            seen.append(index)
            assert comp.finish_reason in ("stop", "length") and len(comp.logprobs) == comp.length
        return seen

    assert sorted(loop.run_until_complete(group(server))) == list(range(6)) and not server.active
    here = loop.run_until_complete(engine.generate_group(prompt, 6, 12, 1.0, seed=5))
    there = loop.run_until_complete(server.generate_group(prompt, 6, 12, 1.0, seed=5))
    assert [c.token_ids for c in there] == [c.token_ids for c in here]
    assert len({tuple(c.token_ids) for c in there}) > 1  # sample i draws with seed + i
    assert all(c.engine == 3 and c.prompt_ids == prompt for c in there)


def test_a_generation_its_caller_cancels_stops_on_the_server(loop, server):
    """A caller that gives up (a timed-out evaluation cancels its tasks) tells the server,
    which aborts the sequences: they generate on for no one otherwise."""
    prompts = [encode(f"{a}+{a}=") for a in range(11, 15)]

    async def tokens_now() -> int:  # every reply carries the server's count of generated tokens
        await server.generate(prompts[0], 1, 0.0)
        return server.generated_tokens

    async def run():
        start = await tokens_now()
        calls = [asyncio.ensure_future(server.generate(p, 240, 1.0, ignore_eos=True)) for p in prompts]
        calls.append(asyncio.ensure_future(server.generate_group(prompts[0], 4, 240, 1.0, ignore_eos=True)))
        await asyncio.sleep(0.5)
        assert not any(c.done() for c in calls)  # cancelled mid-generation, not after
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await asyncio.sleep(0.3)  # the cancels reach the server
        cancelled_at = await tokens_now()
        await asyncio.sleep(2.0)  # 8 sequences of 240 tokens would be done by now
        return start, cancelled_at, await tokens_now()

    start, cancelled_at, later = loop.run_until_complete(run())
    assert cancelled_at - start < 8 * 240  # stopped part-way
    assert later - cancelled_at == 1  # only the one-token probe generated since
    assert not server.active


def test_an_rpc_update_lands_in_flight_with_per_token_versions(loop, server, hf_model):
    """Some request generates under both versions. On a loaded machine every request can
    finish before the update lands, so the check gets three tries: each is a real update,
    and none passes unless a request's tokens carry the old version and then the new."""
    tries = []
    for attempt in range(3):
        state = perturb(hf_model, seed=11 + 100 * attempt)
        version = server.version + 1

        payload = InlineWeights(serialize_state_dict(state))  # ready before the requests start

        async def go():
            tasks = [asyncio.ensure_future(server.generate(encode(f"{i}+{i}="), 240, 1.0, ignore_eos=True))
                     for i in range(32)]
            await _under_way(server)
            timing = await server.update_weights(payload, version)
            return timing, await asyncio.gather(*tasks)

        timing, completions = loop.run_until_complete(go())
        assert timing.version == version == server.version and timing.load_ms > 0
        assert loop.run_until_complete(server.weights_checksum()) == tensors_checksum(state)
        tries.append([c.versions.runs for c in completions])
        if any([v for v, _ in c.versions.runs] == [version - 1, version] for c in completions):
            return
    pytest.fail(f"no request spanned an update in {len(tries)} tries: {tries}")


async def _under_way(client):
    """Once a short request sent after them is done, the long ones run and have tokens."""
    await client.generate(encode("1+1="), 2, 1.0, ignore_eos=True)


async def _broadcast_while_generating(client, state, version):
    broadcaster = WeightBroadcaster(timeout_s=30)
    await broadcaster.open([client])
    try:
        running = [asyncio.ensure_future(client.generate(encode(f"{i}+2="), 240, 1.0, ignore_eos=True))
                   for i in range(12)]
        await _under_way(client)
        [timing] = await broadcaster.broadcast(state, version)
        return timing, await asyncio.gather(*running)
    finally:
        broadcaster.close()


def test_a_collective_update_crosses_the_process_boundary(loop, server, hf_model):
    """The broadcast's barrier is the coordinator's: the server receives after its go."""
    state = perturb(hf_model, seed=12)
    version = server.version + 1
    timing, completions = loop.run_until_complete(_broadcast_while_generating(server, state, version))
    assert timing.version == version == server.version and all(c.length == 240 for c in completions)
    assert any([v for v, _ in c.versions.runs] == [version - 1, version] for c in completions), \
        [c.versions.runs for c in completions]  # kept going under the new weights
    assert loop.run_until_complete(server.weights_checksum()) == tensors_checksum(state)


def test_a_client_without_the_runs_key_is_refused(loop, tiny_model_path, monkeypatch):
    from workers.rollout.client import launch_server, kill_session

    proc, address, _ = launch_server(EngineServerConfig(model_path=tiny_model_path, index=9))
    try:
        with pytest.raises(wire.KeyRefused):
            wire.connect(wire.parse_address(address), REPLIES, key=os.urandom(32))
        # the server is still there for the holder of the key
        channel = wire.connect(wire.parse_address(address), REPLIES)
        channel.close()
    finally:
        kill_session(proc.pid)
        proc.wait()


_LAUNCHER = """
import json, sys, time
from workers.rollout.client import launch_server
from workers.rollout.messages import EngineServerConfig
proc, address, pid = launch_server(EngineServerConfig(model_path=sys.argv[1], index=7))
print(json.dumps({"pid": pid}), flush=True)
time.sleep(600)
"""


def test_a_server_whose_launcher_is_killed_before_it_connects_exits(tiny_model_path):
    # The window between the server's address line and the client's connection: a run's
    # engine SIGKILLed there must not leave the server waiting in accept for good.
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, tiny_model_path], stdout=subprocess.PIPE,
                                cwd=REPO)
    try:
        server_pid = json.loads(launcher.stdout.readline())["pid"]
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 15
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(server_pid)
    if alive:
        os.kill(server_pid, signal.SIGKILL)
    assert not alive, "the engine server outlived its launcher"


def test_a_server_that_no_client_connects_to_exits_at_its_deadline(tiny_model_path):
    from workers.rollout.client import launch_server

    proc, _, _ = launch_server(EngineServerConfig(model_path=tiny_model_path, index=8, accept_timeout_s=1.0))
    try:
        assert proc.wait(timeout=60) == 1
    finally:
        proc.kill()
        proc.wait()


def test_a_drain_server_then_killed_ends_pending_calls_at_once_and_leaves_no_process(loop, tiny_model_path,
                                                                                     hf_model):
    client = EngineClient(EngineServerConfig(model_path=tiny_model_path, index=5, update_mode="drain"))
    loop.run_until_complete(client.start())
    pids = [client.server_pid, *client.core_pids()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    # drain: the server arrives at the coordinator's barrier only once its request finished
    state = perturb(hf_model, seed=13)
    timing, completions = loop.run_until_complete(_broadcast_while_generating(client, state, 1))
    assert timing.version == 1 and all(c.versions.runs == [[0, 240]] for c in completions)
    assert loop.run_until_complete(client.weights_checksum()) == tensors_checksum(state)

    async def go():
        pending = asyncio.ensure_future(client.generate(encode("1+1="), 200, 1.0, ignore_eos=True))
        group = asyncio.ensure_future(client.generate_group(encode("2+2="), 4, 200, 1.0, ignore_eos=True))
        while client.generated_tokens == 0:
            await asyncio.sleep(0.02)
        os.kill(client.server_pid, signal.SIGKILL)
        t0 = time.monotonic()
        completion, samples = await pending, await group
        return completion, samples, time.monotonic() - t0

    completion, samples, waited = loop.run_until_complete(go())
    assert completion.finish_reason == "engine_died" and waited < 5 and client.dead
    # a group's samples not yet back end as engine_died, to be continued elsewhere
    assert len(samples) == 4 and all(c.finish_reason == "engine_died" for c in samples) and not client.active
    with pytest.raises(EngineDied):
        loop.run_until_complete(client.weights_checksum())
    client.shutdown()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)  # its vLLM core went with it


def test_with_priority_scheduling_a_later_request_of_higher_priority_is_served_first(loop, tiny_model_path):
    # one sequence at a time, so the two requests wait in vLLM's queue behind a running one
    client = EngineClient(EngineServerConfig(model_path=tiny_model_path, index=6, max_num_seqs=1,
                                             cpu_single_process=True, priority_scheduling=True))
    loop.run_until_complete(client.start())
    prompt = encode("3+4=")

    async def go():
        running = asyncio.ensure_future(client.generate(prompt, 240, 1.0, ignore_eos=True))
        while client.generated_tokens == 0:
            await asyncio.sleep(0.01)
        low = asyncio.ensure_future(client.generate(prompt, 8, 1.0, ignore_eos=True, priority=10))
        await asyncio.sleep(0.05)  # it arrives first: first-come-first-served would run it first
        high = asyncio.ensure_future(client.generate(prompt, 8, 1.0, ignore_eos=True, priority=1))
        return await running, await low, await high

    try:
        running, low, high = loop.run_until_complete(go())
    finally:
        client.shutdown()
    assert running.length == 240 and low.length == high.length == 8
    assert high.started_at < running.finished_at  # both waited in the queue
    assert high.finished_at < low.finished_at  # it overtook the earlier request in the queue


# -- an engine sharded over two vLLM workers (resources.tensor_parallel: 2) -------------------

def _sharded_config(tiny_model_path) -> EngineServerConfig:
    """What the planner gives a tensor_parallel 2 engine on this machine (sync: all its cores,
    one list per shard in VLLM_CPU_OMP_THREADS_BIND)."""
    from workers.cluster.placement import Machine, plan_placement
    from workers.spec import validate_spec

    spec = validate_spec({"name": "tp", "model": {"path": tiny_model_path}, "task": {"dataset": "gen:add"},
                          "schedule": {"mode": "sync"}, "resources": {"tensor_parallel": 2}})
    plan = plan_placement(spec, Machine(cpu_cores=os.cpu_count() or 1))  # this machine's cores, split in two
    assert plan.engine_processes and plan.tensor_parallel == 2
    assert plan.env(plan.engines[0])["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1  # "0|1" on 2 cores
    return EngineServerConfig(model_path=tiny_model_path, index=7, max_model_len=256, tensor_parallel=2,
                              env=plan.env(plan.engines[0]))


@pytest.mark.distributed
def test_a_two_shard_engine_generates_what_one_shard_generates_and_every_shard_takes_each_update(
        loop, engine, tiny_model_path):
    import copy

    from transformers import AutoModelForCausalLM

    prompts = [encode(f"{a}+{b}=") for a, b in [(12, 34), (5, 67), (80, 9), (41, 41)]]

    async def greedy(e):
        return await asyncio.gather(*(e.generate(p, 12, 0.0, ignore_eos=True) for p in prompts))

    def same(one, two):
        assert [c.token_ids for c in two] == [c.token_ids for c in one]
        # the shards sum their partial products in another order: equal to float32 rounding
        assert max(abs(a - b) for x, y in zip(one, two) for a, b in zip(x.logprobs, y.logprobs)) < 1e-3

    sharded = EngineClient(_sharded_config(tiny_model_path))
    loop.run_until_complete(sharded.start())
    try:
        assert sharded.worker_count == 2 and len(sharded.core_pids()) == 1
        before = loop.run_until_complete(greedy(engine))
        same(before, loop.run_until_complete(greedy(sharded)))

        # an update over the RPC: each shard takes the whole state dict and keeps its slice
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        state = {k: v.clone() for k, v in perturb(model, scale=0.02, seed=21).items()}
        blob = InlineWeights(serialize_state_dict(state))
        loop.run_until_complete(engine.update_weights(blob, engine.version + 1))
        loop.run_until_complete(sharded.update_weights(blob, 1))
        rpc = loop.run_until_complete(greedy(engine))
        assert [c.token_ids for c in rpc] != [c.token_ids for c in before]  # the update changed the policy
        same(rpc, loop.run_until_complete(greedy(sharded)))
        # every shard's checksum is the trainer's (weights_checksum refuses shards that disagree)
        assert loop.run_until_complete(sharded.weights_checksum()) == tensors_checksum(state)

        # a collective update: the engine's two workers are two ranks of the weight group
        state = copy.deepcopy(perturb(model, scale=0.02, seed=22))

        async def broadcast():
            broadcaster = WeightBroadcaster(timeout_s=60)
            await broadcaster.open([sharded])
            try:
                assert broadcaster.group.world_size == 3  # the sender and the two shards
                return await broadcaster.broadcast(state, 2)
            finally:
                broadcaster.close()

        [timing] = loop.run_until_complete(broadcast())
        assert timing.version == 2 == sharded.version
        assert loop.run_until_complete(sharded.weights_checksum()) == tensors_checksum(state)
        loop.run_until_complete(engine.update_weights(InlineWeights(serialize_state_dict(state)), engine.version + 1))
        same(loop.run_until_complete(greedy(engine)), loop.run_until_complete(greedy(sharded)))
    finally:
        sharded.shutdown()
