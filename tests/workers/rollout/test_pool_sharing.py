"""Shared engine pools without an engine (workers/rollout/pool.py): the fair share of an
engine's seats between runs, each run's policy versions behind the pool's labels, which
runs meet on one pool, and what a spec must say to share."""
import asyncio
import time

import pytest

from workers.rollout.engine_types import extend_track
from workers.rollout.fair_seats import FairSeats
from workers.rollout.pool import EnginePool, TenantEngine
from workers.rollout.pool_registry import PoolConfig, pool_settings
from workers.rollout.messages import EngineServerConfig, TenantInfo
from workers.rollout.staleness import VersionTrack
from workers.rollout.tickets import PoolTicket, new_signing_key, sign_ticket
from workers.spec import SpecError, validate_spec


def _backlog(seats: FairSeats, key, n_requests: int, size: int = 1) -> list[asyncio.Task]:
    return [asyncio.ensure_future(seats.acquire(key, size)) for _ in range(n_requests)]


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_busy_runs_hold_seats_in_proportion_to_their_weights():
    async def main():
        seats = FairSeats(8)
        seats.set_weight("a", 1.0)
        seats.set_weight("b", 3.0)
        tasks = _backlog(seats, "a", 20)
        await _settle()
        tasks += _backlog(seats, "b", 20)
        await _settle()
        assert dict(seats.held) == {"a": 8}  # a came first and nothing running is taken away
        for _ in range(6):  # as a's sequences end, each seat goes to b until 2:6 (2/1 = 6/3)
            seats.release("a", 1)
            await _settle()
        assert dict(seats.held) == {"a": 2, "b": 6}
        seats.release("b", 1)  # b at 5/3 < 2/1: the seat goes back to b
        await _settle()
        assert dict(seats.held) == {"a": 2, "b": 6}
        seats.release("a", 1)  # a at 1/1 < 6/3: to a
        await _settle()
        assert dict(seats.held) == {"a": 2, "b": 6}
        for t in tasks:
            t.cancel()
    asyncio.run(main())


def test_a_run_alone_may_hold_every_seat_and_gives_them_back_as_another_arrives():
    async def main():
        seats = FairSeats(8)
        seats.set_weight("a", 1.0)
        a = _backlog(seats, "a", 20)
        await _settle()
        assert seats.held["a"] == 8  # work-conserving: nobody else wants them
        seats.set_weight("b", 1.0)
        b = _backlog(seats, "b", 20)
        await _settle()
        assert seats.held.get("b", 0) == 0  # nothing is taken away from running sequences
        for _ in range(4):  # as a's sequences end, b gets the seats until both hold 4
            seats.release("a", 1)
            await _settle()
        assert (seats.held["a"], seats.held["b"]) == (4, 4)
        seats.release("a", 1)
        await _settle()
        assert (seats.held["a"], seats.held["b"]) == (4, 4)  # a's turn again: 3/1 < 4/1
        for t in a + b:
            t.cancel()
    asyncio.run(main())


def test_a_large_request_takes_the_seats_that_free_and_a_cancelled_waiter_takes_nothing():
    """A group wanting the whole engine waits for no room: it takes each seat that frees
    while it is the most deserving, and asks again for the rest. No seat stays idle for it."""
    async def main():
        seats = FairSeats(4)
        seats.set_weight("a", 1.0)
        seats.set_weight("b", 1.0)
        first = _backlog(seats, "a", 3)
        await _settle()
        group = asyncio.ensure_future(seats.acquire("b", 4))  # a group of 4 samples: the one free seat
        small = _backlog(seats, "a", 1)
        await _settle()
        assert group.result() == 1 and dict(seats.held) == {"a": 3, "b": 1} and not small[0].done()
        rest = asyncio.ensure_future(seats.acquire("b", 3))
        await _settle()
        assert not rest.done()  # the engine is full
        seats.release("a", 1)  # a at 2, b at 1: to b
        await _settle()
        assert rest.result() == 1 and dict(seats.held) == {"a": 2, "b": 2} and not small[0].done()
        small[0].cancel()
        more = asyncio.ensure_future(seats.acquire("b", 2))
        seats.release("a", 2)  # a's cancelled waiter takes nothing: both seats to b
        await _settle()
        assert more.result() == 2 and dict(seats.held) == {"a": 0, "b": 4}
        seats.forget("b")  # b left: its seats are free
        assert seats.used == 0
        for t in first:
            t.cancel()
    asyncio.run(main())


def test_no_grant_exceeds_the_seats_nor_the_grant_cap():
    async def main():
        small = FairSeats(8)
        assert await small.acquire("a", 256) == 8 and dict(small.held) == {"a": 8}
        large = FairSeats(300, max_grant=64)
        assert await large.acquire("a", 256) == 64
        assert await large.acquire("a", 256) == 64 and large.used == 128
    asyncio.run(main())


def test_a_light_run_with_a_large_request_is_not_starved_by_a_heavy_busy_one():
    """Weights 3 and 1 on 8 seats; the heavy run has a backlog of single requests and holds
    every seat, the light one asks for a group of 8: as seats free it gets its 2 of them."""
    async def main():
        seats = FairSeats(8)
        seats.set_weight("a", 3.0)
        seats.set_weight("b", 1.0)
        a = _backlog(seats, "a", 40)
        await _settle()
        granted = []

        async def group(n):
            while n:
                got = await seats.acquire("b", n)
                granted.append(got)
                n -= got

        b = asyncio.ensure_future(group(8))
        for _ in range(8):
            seats.release("a", 1)
            await _settle()
        assert dict(seats.held) == {"a": 6, "b": 2} and granted == [1, 1]  # 6/3 = 2/1
        for _ in range(6):  # the light run's seats end: each goes back to it
            seats.release("b", 1)
            await _settle()
            assert dict(seats.held) == {"a": 6, "b": 2}
        assert b.done() and sum(granted) == 8
        for t in a:
            t.cancel()
    asyncio.run(main())


PLATFORM_KEY, PLATFORM_VERIFIER = new_signing_key()


def _pool(tmp_path, slots=2, seats=256, verifier=None) -> EnginePool:
    engine = EngineServerConfig(model_path=str(tmp_path), index=0, lora_rank=64, max_num_seqs=seats)
    return EnginePool(PoolConfig(pool_id="0123456789ab-0", engine=engine, slots=slots,
                                 verifier=verifier.decode() if verifier else None))


def _ticket(tenant, weight, key=PLATFORM_KEY, run=1, expires_in=3600.0) -> str:
    return sign_ticket(key, PoolTicket(tenant=tenant, weight=weight, run=run, expires=time.time() + expires_in))


def _tenant(pool, team="t1", weight=None, group_size=1) -> TenantEngine:
    """A run of ``team``; with a weight, it brings the platform's ticket for it."""
    t = TenantEngine(pool)
    t.tenant = TenantInfo(run=f"run of {team}", team=team, lora_rank=8, group_size=group_size,
                          ticket=None if weight is None else _ticket(team, weight))
    return t


def test_each_run_reads_its_own_versions_from_the_pool_labels(tmp_path):
    """A labels its updates 1 and 3 (its versions 5 and 6), B label 2 (its version 1): each
    token's label maps to the version of its own run at that label."""
    pool = _pool(tmp_path)
    a, b = _tenant(pool, "t1"), _tenant(pool, "t2")
    asyncio.run(a.start(version=4))
    asyncio.run(b.start(version=0))
    assert (a.slot, b.slot) == (1, 2) and a.lora_id == 1 and b.lora_id == 2
    assert a.engine_label(5) == 1 and b.engine_label(1) == 2 and a.engine_label(6) == 3
    assert [a.policy_version(label) for label in (0, 1, 2, 3, 4)] == [4, 5, 5, 6, 6]
    assert [b.policy_version(label) for label in (0, 1, 2, 3, 4)] == [0, 0, 1, 1, 1]

    class Span:
        def __init__(self, version, start, end):
            self.version, self.start, self.end = version, start, end

    track = VersionTrack()
    extend_track(track, [Span(1, 0, 3), Span(2, 3, 5), Span(3, 5, 9)], 9, 0, a.policy_version)
    assert [tuple(r) for r in track.runs] == [(5, 5), (6, 4)]


def test_a_full_pool_refuses_a_run_and_a_leaving_run_frees_its_slot(tmp_path):
    pool = _pool(tmp_path, slots=2)
    a, b, c = _tenant(pool, "t1"), _tenant(pool, "t2"), _tenant(pool, "t3")
    asyncio.run(a.start())
    asyncio.run(b.start())
    with pytest.raises(RuntimeError, match="all 2 adapter slots are taken"):
        asyncio.run(c.start())
    asyncio.run(a.leave())
    asyncio.run(c.start())
    assert c.slot == 1 and set(pool.tenants) == {1, 2}


def test_a_team_weight_is_split_among_its_runs_on_the_pool(tmp_path):
    pool = _pool(tmp_path, slots=3, verifier=PLATFORM_VERIFIER)
    a1, a2, b = _tenant(pool, "t1", 2.0), _tenant(pool, "t1", 2.0), _tenant(pool, "t2", 2.0)
    for t in (a1, a2, b):
        asyncio.run(t.start())
    assert pool.seats.weights == {1: 1.0, 2: 1.0, 3: 2.0}
    view = pool.view(b)
    assert (view.runs, view.teams, view.fair_share, view.slots) == (3, 2, 0.5, 3)
    assert pool.view(a1).fair_share == 0.25


def test_a_run_in_a_reused_slot_has_a_share_of_its_own_tokens_only(tmp_path):
    """The slot's previous run generated 500 tokens within the share's window: the newcomer's
    share counts its own tokens, not the difference from the old run's."""
    pool = _pool(tmp_path, slots=2)
    a, b = _tenant(pool, "t1"), _tenant(pool, "t2")
    asyncio.run(a.start())
    asyncio.run(b.start())
    a.generated_tokens, b.generated_tokens = 500, 100
    pool.view(b)  # a mark with a's 500
    asyncio.run(a.leave())
    c = _tenant(pool, "t3")
    asyncio.run(c.start())
    assert c.slot == 1  # a's
    c.generated_tokens, b.generated_tokens = 30, 130
    view = pool.view(c)
    assert view.share == 0.5 and pool.view(b).share == 0.5  # 30 of the 60 generated since the mark


def test_a_run_cannot_join_with_a_larger_adapter_than_the_pool_serves(tmp_path):
    pool = _pool(tmp_path)
    t = TenantEngine(pool)
    t.tenant = TenantInfo(run="r", team="t", lora_rank=128)
    with pytest.raises(ValueError, match="up to rank 64"):
        asyncio.run(t.start())


def test_runs_of_any_task_on_a_model_meet_at_its_own_length(tmp_path, tiny_model_path):
    """The pool's length cap is the model's own: a run of short prompts and one of long meet."""
    import json

    own = json.loads(open(f"{tiny_model_path}/config.json").read())["max_position_embeddings"]
    short = EngineServerConfig(model_path=tiny_model_path, index=0, max_model_len=16, lora_rank=8)
    long_ = short.model_copy(update={"max_model_len": 40})
    assert pool_settings(short, 8)[0] == pool_settings(long_, 8)[0]
    assert pool_settings(short, 8)[1].max_model_len == min(own, 4096)


def test_runs_of_similar_tasks_meet_on_one_pool_and_other_models_do_not(tmp_path):
    base = EngineServerConfig(model_path=str(tmp_path), index=0, max_model_len=200, seed=3, top_p=0.9,
                              update_mode="interrupt", lora_rank=16)
    same = base.model_copy(update={"max_model_len": 230, "seed": 9, "top_p": 1.0, "stop": ["\n"],
                                   "update_mode": "keep", "lora_rank": 16})
    pid, engine = pool_settings(base, 16)
    assert pool_settings(same, 16)[0] == pid
    assert pool_settings(base, 32)[0] != pid  # a larger rank class: another pool
    assert engine.max_model_len == 256 and engine.lora_rank == 16 and engine.seed == 0  # no config.json here
    assert pool_settings(base.model_copy(update={"max_model_len": 16}), 16)[0] != pid  # no config.json: the run's own
    assert pid.endswith("-0") and pool_settings(base.model_copy(update={"index": 1}), 16)[0].endswith("-1")
    other = tmp_path / "other"
    other.mkdir()
    assert pool_settings(base.model_copy(update={"model_path": str(other)}), 16)[0] != pid
    assert pool_settings(base.model_copy(update={"dtype": "bfloat16"}), 16)[0] != pid
    assert pool_settings(base.model_copy(update={"max_model_len": 300}), 16)[0] != pid
    assert pool_settings(base.model_copy(update={"env": {"CUDA_VISIBLE_DEVICES": "1"}}), 16)[0] != pid  # elsewhere


@pytest.mark.parametrize("change, message", [
    ({}, "model.lora"),
    ({"model": {"lora": {"rank": 8}}, "schedule": {"dispatch": "skew_aware"}},
     "schedule.dispatch other than 'skew_aware'"),
    ({"model": {"lora": {"rank": 8}}, "rollout": {"share_engines": True, "update_mode": "drain"}},
     "rollout.update_mode 'keep' or 'interrupt'"),
])
def test_a_spec_that_cannot_share_engines_is_refused_by_the_field_that_asks(tiny_model_path, change, message):
    spec = {"name": "s", "model": {"path": tiny_model_path}, "task": {"dataset": "gen:add"},
            "rollout": {"share_engines": True}}
    for section, values in change.items():
        spec[section] = {**spec.get(section, {}), **values}
    with pytest.raises(SpecError, match=f"rollout.share_engines needs {message}"):
        validate_spec(spec)


def test_the_registry_is_kept_per_pid_namespace_and_stop_pools_kills_only_its_own(tmp_path, monkeypatch):
    """Containers sharing FLUXRL_POOL_DIR see each other's processes under other pids: an entry
    of another PID namespace is neither read (its pid could name an unrelated process here)
    nor killed by stop_pools."""
    import json
    import subprocess
    import sys

    from workers.io.lifetime import pid_alive, pid_namespace
    from workers.rollout.pool_registry import DIR_ENV, read_registry, registry_file, stop_pools

    folder = tmp_path / "pools"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(DIR_ENV, str(folder))
    ours, theirs = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
                    for _ in range(2))
    try:
        registry_file("p1").write_text(json.dumps({"address": "127.0.0.1:1", "pid": ours.pid}))
        (folder / f"p1.ns{pid_namespace() + 1}.json").write_text(json.dumps({"address": "x", "pid": theirs.pid}))
        assert registry_file("p1").name == f"p1.ns{pid_namespace()}.json"
        assert read_registry("p1")["pid"] == ours.pid
        assert read_registry("p2") is None
        assert stop_pools() == 1
        ours.wait(timeout=10)
        assert pid_alive(theirs.pid) and (folder / f"p1.ns{pid_namespace() + 1}.json").exists()
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()


class _Vllm:
    """Stands in for vLLM under TenantEngine: every sequence a request starts runs until the
    test ends the oldest running one (each sequence takes one turn of the engine)."""

    def __init__(self):
        self.running: list[tuple[int, asyncio.Event]] = []  # (slot, its end), oldest first

    def holding(self, slot) -> int:
        return sum(1 for s, _ in self.running if s == slot)

    async def end_oldest(self):
        _, ended = self.running.pop(0)
        ended.set()
        await _settle()

    def patch(self, monkeypatch):
        from workers.rollout.engine import RolloutEngine

        vllm = self

        async def stream_group(engine, prompt_ids, n, max_tokens, temperature, seed=None, ignore_eos=False,
                               priority=0):
            ends = [asyncio.Event() for _ in range(n)]
            vllm.running.extend((engine.slot, e) for e in ends)
            for i, end in enumerate(ends):
                await end.wait()
                yield i, ("sample seeded", seed + i)

        async def generate(engine, prompt_ids, max_tokens, temperature, seed=None, ignore_eos=False, priority=0):
            end = asyncio.Event()
            vllm.running.append((engine.slot, end))
            await end.wait()
            return "completion"

        monkeypatch.setattr(RolloutEngine, "stream_group", stream_group)
        monkeypatch.setattr(RolloutEngine, "generate", generate)


def test_a_group_of_256_on_8_seats_takes_no_more_than_its_share_while_another_run_waits(tmp_path, monkeypatch):
    """Run a streams one group of 256 samples on a pool of 8 seats; run b (same weight) then
    sends 16 requests. The group is split into pieces of the seats granted: it holds 8 only
    while alone, and from b's arrival every seat that frees goes to the run holding fewer,
    until both hold 4; b's 16 are done long before a's group, which comes out whole, each
    sample with its own seed, in its indices."""
    vllm = _Vllm()
    vllm.patch(monkeypatch)
    pool = _pool(tmp_path, seats=8)
    a, b = _tenant(pool, "t1", group_size=8), _tenant(pool, "t2")

    async def main():
        await a.start()
        await b.start()
        samples = {}

        async def group():
            async for index, sample in a.stream_group([1, 2], 256, 8, 1.0, seed=1000):
                samples[index] = sample

        streaming = asyncio.ensure_future(group())
        await _settle()
        assert (vllm.holding(a.slot), pool.seats.held[a.slot]) == (8, 8)  # alone: every seat, one grant of 8
        requests = [asyncio.ensure_future(b.generate([3], 8, 1.0)) for _ in range(16)]
        await _settle()
        held = []  # (a, b) after each sequence ends, while b has requests waiting
        while not all(r.done() for r in requests):
            await vllm.end_oldest()
            held.append((vllm.holding(a.slot), vllm.holding(b.slot)))
        assert held[:4] == [(7, 1), (6, 2), (5, 3), (4, 4)]  # each freed seat to b until level
        assert all(h == (4, 4) for h in held[4:-4]), held  # then level while both are busy (b's last 4 end)
        assert max(h[0] for h in held) <= 8 and len(samples) < 256 - 8  # b done long before a's group
        while not streaming.done():
            await vllm.end_oldest()
        assert sorted(samples) == list(range(256))
        assert all(samples[i] == ("sample seeded", 1000 + i) for i in range(256))
        assert pool.seats.used == 0

    asyncio.run(main())


def test_a_group_larger_than_the_pool_seats_is_refused_at_spec_time_and_at_join(tmp_path, tiny_model_path):
    spec = {"name": "s", "model": {"path": tiny_model_path, "lora": {"rank": 8}}, "task": {"dataset": "gen:add"},
            "rollout": {"share_engines": True, "max_num_seqs": 8}, "algorithm": {"group_size": 16}}
    with pytest.raises(SpecError, match=r"algorithm.group_size at most rollout.max_num_seqs \(16 > 8"):
        validate_spec(spec)
    with pytest.raises(SpecError, match="algorithm.group_size: Input should be less than or equal to 1024"):
        validate_spec({**spec, "rollout": {}, "algorithm": {"group_size": 1025}})
    pool = _pool(tmp_path, seats=8)
    with pytest.raises(ValueError, match="algorithm.group_size 16 is more than the 8 seats of this shared engine pool"):
        asyncio.run(_tenant(pool, "t1", group_size=16).start())
    assert not pool.tenants


def test_a_weight_counts_only_in_a_ticket_the_platform_signed(tmp_path):
    """On a platform's pool, a run that claims weight 1000, in a ticket signed with another
    key or an expired one, or with no ticket at all, runs at weight 1 as tenant "unverified"
    (one tenant for all of them); a ticket the platform signed counts."""
    pool = _pool(tmp_path, slots=4, verifier=PLATFORM_VERIFIER)
    honest = _tenant(pool, "team-1", weight=1.0)
    forger_key, _ = new_signing_key()
    forged, expired, bare = (TenantEngine(pool) for _ in range(3))
    forged.tenant = TenantInfo(run="f", team="team-2", lora_rank=8, ticket=_ticket("team-2", 1000.0, key=forger_key))
    expired.tenant = TenantInfo(run="e", team="team-3", lora_rank=8,
                                ticket=_ticket("team-3", 1000.0, expires_in=-1.0))
    bare.tenant = TenantInfo(run="b", team="team-4", lora_rank=8)
    for t in (honest, forged, expired, bare):
        asyncio.run(t.start())
    assert pool.view(honest).fair_share == 0.5 and pool.view(forged).fair_share == round(0.5 / 3, 4)
    assert [t.team for t in (forged, expired, bare)] == ["unverified"] * 3
    asyncio.run(forged.leave())
    signed = _tenant(pool, "team-2", weight=3.0)
    asyncio.run(signed.start())
    assert (signed.team, pool.view(signed).fair_share) == ("team-2", 0.6)  # 3 of 1 + 3 + 1


def test_without_a_platform_a_weight_in_the_environment_counts_for_nothing(tmp_path, monkeypatch):
    from workers.rollout.pool_client import tenant_info

    monkeypatch.setenv("FLUXRL_POOL_WEIGHT", "1000")
    monkeypatch.setenv("FLUXRL_POOL_TEAM", "team-9")
    local = _pool(tmp_path, slots=2)
    claimer, other = TenantEngine(local), _tenant(local, "team-8")
    claimer.tenant = tenant_info("r", 8, "keep", 1.0, -1, [], [])
    for t in (claimer, other):
        asyncio.run(t.start())
    assert local.view(claimer).fair_share == 0.5 and claimer.team == "team-9"  # not 1000 / 1001
