"""A shared engine pool with the real engine (workers/rollout/pool.py; vLLM on the CPU): runs
of two teams on one vLLM engine, each generating with its own adapter in its own slot, with
its own per-token versions across the other's updates, a share of the seats by team weight;
a run whose connection drops frees its slot, and nothing of its adapter reaches the run that
takes the slot next; the idle pool exits."""
import asyncio
import json
import os
import time

import pytest

from tests.workers.rollout.lora_adapters import adapter_file, model_logprobs, seeded_adapter
from workers.models.tinymodel import encode
from workers.rollout.pool_client import PoolClient
from workers.rollout.pool_registry import (DIR_ENV, IDLE_ENV, SLOTS_ENV, read_registry, pool_settings,
                                           stop_pools)
from workers.rollout.messages import EngineServerConfig, TenantInfo
from workers.rollout.tickets import VERIFIER_ENV, PoolTicket, new_signing_key, sign_ticket

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

IDLE_S = 4


KEY, VERIFIER = new_signing_key()  # the platform's, as runs/tickets.py makes it


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pools")
    folder.chmod(0o700)
    verifier = tmp_path_factory.mktemp("platform") / "pool-tickets.ed25519.pub"
    verifier.write_bytes(VERIFIER)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DIR_ENV, str(folder))
        mp.setenv(VERIFIER_ENV, str(verifier))
        mp.setenv(SLOTS_ENV, "2")
        mp.setenv(IDLE_ENV, str(IDLE_S))
        yield folder
        stop_pools()


def _config(tiny_model_path, seed=0) -> EngineServerConfig:
    return EngineServerConfig(model_path=tiny_model_path, index=0, max_model_len=256, max_num_seqs=8, seed=seed,
                              cpu_single_process=True, lora_rank=8)


def _client(tiny_model_path, team, weight=1.0, seed=0) -> PoolClient:
    """A run of ``team`` with the platform's ticket for ``weight``."""
    ticket = sign_ticket(KEY, PoolTicket(tenant=team, weight=weight, run=0, expires=time.time() + 3600))
    return PoolClient(_config(tiny_model_path, seed), TenantInfo(run=f"run of {team}", team=team, ticket=ticket,
                                                                 lora_rank=8))


async def _gap(engine, model, prompt="12+34="):
    comp = await engine.generate(encode(prompt), max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    return max(abs(a - b) for a, b in zip(model_logprobs(model, comp), comp.logprobs)), comp


@pytest.fixture(scope="module")
def adapters(tiny_model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    models = {name: seeded_adapter(tiny_model_path, seed) for name, seed in
              (("base", None), ("a1", 1), ("b0", 2), ("b1", 3), ("a2", 4))}
    files = {name: adapter_file(model, folder, name)[0] for name, model in models.items()}
    return models, files


@pytest.fixture(scope="module")
def two_teams(loop, pools, tiny_model_path, adapters):
    _, files = adapters
    # a pool that died and left its entry behind (a live pid, nobody listening): a run that
    # finds it drops the entry and starts a new pool
    from workers.io.ports import free_port
    from workers.rollout.pool_registry import registry_file

    stale = pool_settings(_config(tiny_model_path), 8)[0]
    registry_file(stale).write_text(json.dumps({"address": f"127.0.0.1:{free_port('127.0.0.1')}",
                                                 "pid": os.getpid()}))
    a, b = _client(tiny_model_path, "team-a"), _client(tiny_model_path, "team-b", seed=1)
    loop.run_until_complete(a.start(weights=files["base"], version=0))
    assert read_registry(stale)["pid"] == a.server_pid != os.getpid()
    loop.run_until_complete(b.start(weights=files["b0"], version=0))
    yield a, b
    for client in (a, b):
        client.shutdown()


def test_runs_of_two_teams_share_one_engine_each_with_its_own_adapter(loop, two_teams, adapters):
    a, b = two_teams
    models, _ = adapters
    assert a.pool_id == b.pool_id and a.server_pid == b.server_pid  # one pool process, one engine
    assert b.pool.runs == 2 and b.pool.teams == 2 and b.pool.fair_share == 0.5 and b.pool.slot != a.pool.slot
    gap, _ = loop.run_until_complete(_gap(a, models["base"]))
    assert gap < 1e-3  # a's adapter (B = 0): the base model
    gap, _ = loop.run_until_complete(_gap(b, models["b0"]))
    assert gap < 1e-3  # b's own adapter, exactly
    assert loop.run_until_complete(_gap(b, models["base"]))[0] > 1e-2


def test_each_run_keeps_its_own_versions_and_adapter_across_the_others_updates(loop, two_teams, adapters):
    """B generates while A's update to version 1 lands in flight: every token of B's is B's
    version 0 under B's adapter, A's tokens after it are A's version 1 under A's new one."""
    a, b = two_teams
    models, files = adapters

    async def main():
        running = [asyncio.ensure_future(b.generate(encode(f"{i}+{i}="), 80, 1.0, seed=i, ignore_eos=True))
                   for i in range(3)]
        await asyncio.sleep(0.3)
        await a.update_weights(files["a1"], 1)
        return await asyncio.gather(*running)

    comps = loop.run_until_complete(main())
    for c in comps:
        assert c.length == 80 and [v for v, _ in c.versions.runs] == [0]
        assert max(abs(x - y) for x, y in zip(model_logprobs(models["b0"], c), c.logprobs)) < 1e-3
    gap, comp = loop.run_until_complete(_gap(a, models["a1"]))
    assert gap < 1e-3 and [v for v, _ in comp.versions.runs] == [1]
    loop.run_until_complete(b.update_weights(files["b1"], 7))
    gap, comp = loop.run_until_complete(_gap(b, models["b1"]))
    assert gap < 1e-3 and [v for v, _ in comp.versions.runs] == [7]
    gap, comp = loop.run_until_complete(_gap(a, models["a1"]))  # b's update left a as it was
    assert gap < 1e-3 and [v for v, _ in comp.versions.runs] == [1]
    assert loop.run_until_complete(b.weights_checksum()) != loop.run_until_complete(a.weights_checksum())


def test_a_pool_takes_no_weight_file_by_path_since_it_could_be_another_runs(loop, two_teams, adapters):
    """One run's own engine server on this host takes the trainer's file by its path; a pool
    serves several teams' runs, so its runs send every update over the wire."""
    from workers.rollout.client import _request_ids
    from workers.rollout.messages import UpdateRequest, WeightsByPath

    a, b = two_teams
    _, files = adapters
    assert not a.same_files and not b.same_files
    with pytest.raises(Exception, match="takes weights by the wire only"):
        loop.run_until_complete(a._request(UpdateRequest(id=next(_request_ids), version=9,
                                                         weights=WeightsByPath(path=files["b1"].file.path)),
                                           timed=False))
    assert loop.run_until_complete(a.weights_checksum()) != loop.run_until_complete(b.weights_checksum())


def test_a_full_pool_refuses_a_third_run(loop, two_teams, tiny_model_path):
    c = _client(tiny_model_path, "team-c")
    with pytest.raises(RuntimeError, match="all 2 adapter slots are taken"):
        loop.run_until_complete(c.start())
    c.shutdown()


def test_a_group_split_across_grants_comes_back_whole_with_each_samples_own_seed(loop, two_teams):
    """8 seats, b running 3 long requests: a's group of 8 gets the 5 free seats at once and
    the rest as seats free, so more than one vLLM request (each stamps its samples with its
    own start); its samples are those one request gives (sample i seeded seed + i)."""
    a, b = two_teams
    prompt = encode("7+8=")

    async def main():
        whole = await a.generate_group(prompt, 8, 12, 1.0, seed=11, ignore_eos=True)
        long = [asyncio.ensure_future(b.generate(encode(f"{i}+1="), 230, 1.0, seed=i, ignore_eos=True))
                for i in range(3)]
        await asyncio.sleep(0.05)  # b's 3 hold their seats
        split = await a.generate_group(prompt, 8, 12, 1.0, seed=11, ignore_eos=True)
        return whole, split, await asyncio.gather(*long)

    whole, split, long = loop.run_until_complete(main())
    assert len({c.started_at for c in whole}) == 1 and len({c.started_at for c in split}) > 1
    assert max(c.started_at for c in split) < min(c.finished_at for c in long)  # not waiting for b
    assert [c.token_ids for c in split] == [c.token_ids for c in whole]
    assert len({tuple(c.token_ids) for c in whole}) > 1  # each sample its own seed


def test_generation_is_shared_by_team_weight_while_both_runs_are_busy(loop, pools, tiny_model_path, two_teams):
    """Team weights 1 and 3 on a pool of 8 seats: interleaved backlogs of 24 requests each; by
    the time B's are done A has run about a third as many (first come, first served would
    give each half)."""
    a, b = two_teams
    heavy = _client(tiny_model_path, "team-b", weight=3.0)
    b.shutdown()  # b's slot for a run of team-b with weight 3
    loop.run_until_complete(heavy.start())
    try:
        async def main():
            finished = {"a": [], "b": []}

            async def one(engine, name, i):
                await engine.generate(encode(f"{i}+1="), 32, 1.0, seed=i, ignore_eos=True)
                finished[name].append(time.perf_counter())

            tasks = []
            for i in range(24):
                tasks.append(asyncio.ensure_future(one(a, "a", i)))
                tasks.append(asyncio.ensure_future(one(heavy, "b", i)))
            await asyncio.gather(*tasks)
            return finished

        finished = loop.run_until_complete(main())
        b_done = max(finished["b"])
        a_before = sum(1 for t in finished["a"] if t < b_done)
        assert 24 * 0.25 <= a_before <= 24 * 0.75, (a_before, finished)
        assert heavy.pool.fair_share == 0.75
    finally:
        heavy.shutdown()


def test_a_run_that_drops_frees_its_slot_and_its_adapter_reaches_nobody(loop, pools, tiny_model_path, two_teams,
                                                                           adapters):
    a, _ = two_teams
    models, files = adapters
    loop.run_until_complete(a.update_weights(files["a2"], 2))
    other = _client(tiny_model_path, "team-b")
    loop.run_until_complete(other.start())
    slot = a.pool.slot

    async def drop_a_mid_generation():
        running = [asyncio.ensure_future(other.generate(encode(f"{i}+2="), 60, 1.0, seed=i, ignore_eos=True))
                   for i in range(3)]
        doomed = asyncio.ensure_future(a.generate(encode("9+9="), 200, 1.0, ignore_eos=True))
        await asyncio.sleep(0.3)
        a.channel.close()  # the run's process is gone: its connection drops
        return await asyncio.gather(*running), await doomed

    comps, lost = loop.run_until_complete(drop_a_mid_generation())
    assert all(c.length == 60 for c in comps)  # the other run's generations were not disturbed
    assert lost.finish_reason == "engine_died"  # on a's side: the engine is gone for it
    newcomer = _client(tiny_model_path, "team-c")
    deadline = time.monotonic() + 10
    while True:  # the pool notices the drop at once; the slot is free when the leave is done
        try:
            loop.run_until_complete(newcomer.start())
            break
        except RuntimeError:
            assert time.monotonic() < deadline
            newcomer = _client(tiny_model_path, "team-c")
            time.sleep(0.2)
    assert newcomer.pool.slot == slot  # a's slot
    gap, _ = loop.run_until_complete(_gap(newcomer, models["base"]))
    assert gap < 1e-3  # before its first adapter: the base model, not a's adapter left in the slot
    newcomer.shutdown()
    other.shutdown()


def test_the_idle_pool_exits_and_leaves_no_registry(loop, pools, tiny_model_path, two_teams):
    a, b = two_teams
    for client in (a, b):
        client.shutdown()
    pid_ = pool_settings(_config(tiny_model_path), 8)[0]
    info = read_registry(pid_)
    assert info is not None
    # a connection that never joins (a stuck or refused start) does not keep the pool awake
    from workers.io import wire
    from workers.rollout.pool_registry import pool_key
    from workers.rollout.messages import REPLIES

    lingering = wire.connect(wire.parse_address(info["address"]), REPLIES, pool_key())
    deadline = time.monotonic() + IDLE_S + 20
    while read_registry(pid_) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert read_registry(pid_) is None
    while time.monotonic() < deadline:
        try:
            os.kill(info["pid"], 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the idle pool did not exit")
    lingering.close()
