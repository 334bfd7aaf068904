"""Shared engine pools without an engine (workers/rollout/pool.py): the fair share of an
engine's seats between runs, each run's policy versions behind the pool's labels, which
runs meet on one pool, and what a spec must say to share."""
import asyncio

import pytest

from workers.rollout.engine import extend_track
from workers.rollout.pool import EnginePool, FairSeats, PoolConfig, TenantEngine, pool_settings
from workers.rollout.messages import EngineServerConfig, TenantInfo
from workers.rollout.staleness import VersionTrack
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


def test_a_large_request_is_not_overtaken_and_a_cancelled_waiter_takes_nothing():
    async def main():
        seats = FairSeats(4)
        seats.set_weight("a", 1.0)
        seats.set_weight("b", 1.0)
        first = _backlog(seats, "a", 3)
        await _settle()
        group = asyncio.ensure_future(seats.acquire("b", 4))  # a group of 4 samples: needs the whole engine
        small = _backlog(seats, "a", 1)
        await _settle()
        assert seats.held["a"] == 3 and not group.done()
        seats.release("a", 1)  # one seat free, but b's group is the most deserving: a's small one waits
        await _settle()
        assert seats.held["a"] == 2 and not small[0].done()
        small[0].cancel()
        await _settle()
        seats.release("a", 2)
        await _settle()
        assert group.done() and seats.held["b"] == 4 and seats.held["a"] == 0
        seats.forget("b")  # b left: its seats are free
        assert seats.used == 0
        for t in first:
            t.cancel()
    asyncio.run(main())


def _pool(tmp_path, slots=2) -> EnginePool:
    engine = EngineServerConfig(model_path=str(tmp_path), index=0, lora_rank=64)
    return EnginePool(PoolConfig(pool_id="0123456789ab-0", engine=engine, slots=slots))


def _tenant(pool, team="t1", weight=1.0) -> TenantEngine:
    t = TenantEngine(pool)
    t.tenant = TenantInfo(run=f"run of {team}", team=team, weight=weight, lora_rank=8)
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
    pool = _pool(tmp_path, slots=3)
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
    from workers.rollout.pool import DIR_ENV, _read_registry, _registry_file, stop_pools

    folder = tmp_path / "pools"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(DIR_ENV, str(folder))
    ours, theirs = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
                    for _ in range(2))
    try:
        _registry_file("p1").write_text(json.dumps({"address": "127.0.0.1:1", "pid": ours.pid}))
        (folder / f"p1.ns{pid_namespace() + 1}.json").write_text(json.dumps({"address": "x", "pid": theirs.pid}))
        assert _registry_file("p1").name == f"p1.ns{pid_namespace()}.json"
        assert _read_registry("p1")["pid"] == ours.pid
        assert _read_registry("p2") is None
        assert stop_pools() == 1
        ours.wait(timeout=10)
        assert pid_alive(theirs.pid) and (folder / f"p1.ns{pid_namespace() + 1}.json").exists()
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()
