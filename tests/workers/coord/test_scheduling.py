"""Dispatch policies: exact orders and engine assignments."""

import math

import pytest

from workers.coord.scheduling import (DispatchWindow, EngineLoads, LongTailThreshold, dispatch_order, least_loaded,
                                      plan_dispatch, plan_skew_aware, plan_tail_gathering, plan_tail_migration, priority,
                                      split_engines)

PREDICTED = [5, 40, 10, 40, 2, 20]


def test_fifo_keeps_arrival_order():
    assert dispatch_order("fifo", PREDICTED) == [0, 1, 2, 3, 4, 5]


def test_random_is_a_seeded_permutation():
    a = dispatch_order("random", PREDICTED, seed=1)
    assert a == dispatch_order("random", PREDICTED, seed=1)
    assert sorted(a) == list(range(6)) and a != dispatch_order("random", PREDICTED, seed=2)


def test_longest_first_orders_by_prediction_and_keeps_arrival_order_among_equals():
    assert dispatch_order("longest_first", PREDICTED) == [1, 3, 5, 2, 0, 4]


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="longest_first"):
        dispatch_order("shortest", PREDICTED)


def test_least_loaded_breaks_ties_by_lowest_index():
    assert least_loaded([3.0, 1.0, 1.0]) == 1


def test_longest_first_spreads_long_groups_and_balances_predicted_tokens():
    plan = plan_dispatch("longest_first", PREDICTED, engine_loads=[0, 0])
    # 40→e0, 40→e1, 20→e0 (40 vs 40), 10→e1 (60 vs 40), 5→e1 (60 vs 50), 2→e1 (60 vs 55)
    assert plan == [(1, 0), (3, 1), (5, 0), (2, 1), (0, 1), (4, 1)]
    loads = [0, 0]
    for i, e in plan:
        loads[e] += PREDICTED[i]
    assert loads == [60, 57]


def test_longest_first_counts_the_engines_current_load():
    plan = plan_dispatch("longest_first", [30, 10], engine_loads=[25, 0, 5])
    assert plan == [(0, 1), (1, 2)]


def test_length_blind_policies_place_every_group_as_average_sized():
    # equal loads: round robin in dispatch order, whatever the predictions
    assert plan_dispatch("fifo", PREDICTED, engine_loads=[0, 0, 0]) == [(0, 0), (1, 1), (2, 2), (3, 0), (4, 1), (5, 2)]
    # mean prediction is 19.5: engine 0 (load 30) gets a group only once the others pass 30
    assert [e for _, e in plan_dispatch("fifo", PREDICTED, engine_loads=[30, 0])] == [1, 1, 0, 1, 0, 1]


def test_with_equal_predictions_longest_first_is_fifo():
    same = [7.0] * 5
    assert plan_dispatch("longest_first", same, [0, 0]) == plan_dispatch("fifo", same, [0, 0])


def test_dispatching_needs_an_engine():
    with pytest.raises(ValueError, match="no engines"):
        plan_dispatch("fifo", [1.0], engine_loads=[])


def test_engine_loads_pick_by_tokens_for_longest_first_and_by_groups_otherwise():
    loads = EngineLoads(2)
    loads.start(0, 100.0)
    loads.start(1, 10.0)
    loads.start(1, 10.0)
    assert loads.pick("longest_first") == 1 and loads.pick("fifo") == 0
    loads.finish(0, 100.0)
    assert loads.tokens == [0.0, 20.0] and loads.groups == [0, 2]


def test_tail_migration_moves_half_the_gap_once_few_requests_remain():
    assert plan_tail_migration([6, 0], tail=8) == (0, 1, 3)
    assert plan_tail_migration([1, 7, 2], tail=10) == (1, 0, 3)  # busiest → idlest
    assert plan_tail_migration([5, 4], tail=10) is None  # balanced enough
    assert plan_tail_migration([20, 0], tail=8) is None  # not the tail yet
    assert plan_tail_migration([0, 0], tail=8) is None
    assert plan_tail_migration([6], tail=8) is None  # nowhere to go


def test_overdue_groups_start_first_in_arrival_order_under_longest_first():
    assert dispatch_order("longest_first", [5, 1, 9, 2], overdue=[False, True, False, True]) == [1, 3, 2, 0]
    assert dispatch_order("fifo", [5, 1, 9, 2], overdue=[True, True, False, False]) == [0, 1, 2, 3]


def _first_start(aging: bool, rounds: int = 200, size: int = 4) -> dict[int, int]:
    """Longest-first over a window where every newcomer is predicted longer than all before it
    (row k: k tokens), one start per dispatch: the round each row started at."""
    window, source, started = DispatchWindow(size), iter(range(10**6)), {}
    for r in range(rounds):
        window.fill(1, source)
        order = dispatch_order("longest_first", [float(k) for k in window.rows],
                               overdue=window.overdue() if aging else None)
        started[window.take(order[:1])[0]] = r
    return started


def test_aging_bounds_how_long_a_predicted_short_group_waits():
    without = _first_start(aging=False)
    assert 0 not in without  # row 0 (the shortest) never starts: newcomers are always longer
    started = _first_start(aging=True)
    assert all(k in started for k in range(150))  # every early row starts
    assert max(started[k] - k for k in range(150)) <= 2 * 4 + 1  # within ~2 windows of arriving


# -- skew_aware: StreamRL's skewness-aware dispatch ---------------------------------------

def test_skew_aware_sends_predicted_long_groups_to_the_long_tail_engines_and_packs_the_rest():
    # engine 0 serves the long tail; groups at or above 50 predicted tokens are long
    plan = plan_skew_aware([10, 50, 20, 80, 5, 30], [0, 0, 0], long_tail=[True, False, False], threshold=50)
    assert plan == [(3, 0), (1, 0), (5, 1), (2, 2), (0, 2), (4, 1)]  # longest first, each pool by its load


def test_skew_aware_with_one_pool_empty_uses_the_other():
    assert plan_skew_aware([10, 90], [0], long_tail=[False], threshold=50) == [(1, 0), (0, 0)]
    assert plan_skew_aware([10, 90], [0, 0], long_tail=[True, True], threshold=50) == [(1, 0), (0, 1)]


def test_skew_aware_starts_overdue_groups_first():
    plan = plan_skew_aware([5, 1, 9], [0, 0], long_tail=[True, False], threshold=9, overdue=[False, True, False])
    assert [i for i, _ in plan] == [1, 2, 0] and dict(plan)[2] == 0


def test_the_split_balances_both_pools_finishing_times_by_measured_rates():
    # 100 long tokens at 5/s per engine vs 900 bulk at 10/s: k=1 → max(20, 30) = 30; k=2 → max(10, 45)
    assert split_engines(4, 100, 900, long_rate=5, bulk_rate=10) == 1
    # a slower long-tail engine earns more engines: k=2 → max(40, 30) beats k=1 (80) and k=3 (60)
    assert split_engines(4, 400, 600, long_rate=5, bulk_rate=10) == 2
    assert split_engines(2, 1, 1000, 1, 1) == 1  # both roles keep at least one engine
    assert split_engines(1, 100, 100, 1, 1) == 0  # one engine: no long-tail pool


def test_the_long_tail_cut_is_the_recent_predictions_top_share():
    cut = LongTailThreshold(0.25)
    assert cut.threshold() == math.inf and cut.percentile(3) == 1.0
    cut.observe([1, 2, 3, 4, 5, 6, 7, 8])
    assert cut.threshold() == 7  # the longest ⌈0.25·8⌉ = 2 are 8 and 7
    assert cut.threshold(pending=[20, 30]) == 8  # ⌈0.25·10⌉ = 3: 30, 20, 8
    assert cut.percentile(4) == 0.5 and cut.percentile(0) == 0.0
    with pytest.raises(ValueError):
        LongTailThreshold(1.0)


def test_vllm_priorities_put_longer_first_but_nothing_behind_more_than_aging_later_arrivals():
    assert priority(10, 1.0, aging=8) == 10 and priority(10, 0.0, aging=8) == 18 and priority(10, 0.5, 8) == 14
    # the shortest group dispatched at 10 can be overtaken only by groups dispatched before 18
    short = priority(10, 0.0, aging=8)
    assert all(priority(later, 1.0, aging=8) < short for later in range(11, 18))
    assert all(priority(later, p, aging=8) >= short for later in range(18, 40) for p in (0.0, 0.5, 1.0))


def test_tail_gathering_moves_a_small_tail_onto_the_engine_running_the_most():
    assert plan_tail_gathering([3, 1, 0, 2], tail=6, capacity=16) == (0, [1, 3])
    assert plan_tail_gathering([2, 2], tail=6, capacity=16) == (0, [1])  # the lower index among equals
    assert plan_tail_gathering([4, 3], tail=6, capacity=16) is None  # not yet the tail
    assert plan_tail_gathering([0, 5], tail=6, capacity=16) is None  # already on one engine
    assert plan_tail_gathering([3, 2], tail=6, capacity=4) is None  # would not fit one engine's batch
    assert plan_tail_gathering([0, 0], tail=6, capacity=16) is None


def test_a_fixed_long_tail_split_starts_its_engines_with_their_own_small_batch(tmp_path):
    from workers.coord.processes import Processes
    from workers.spec import SpecError, validate_spec

    raw = {"name": "skew", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
           "rollout": {"engines": 4, "max_num_seqs": 64},
           "schedule": {"dispatch": "skew_aware", "long_tail": {"engines": 1, "max_num_seqs": 4}}}
    processes = Processes(validate_spec(raw), tmp_path, None, lambda error: None)
    assert [processes.max_num_seqs(i) for i in range(4)] == [4, 64, 64, 64]  # engine 0 serves the long tail
    raw["schedule"]["dispatch"] = "longest_first"
    assert Processes(validate_spec(raw), tmp_path, None, lambda error: None).max_num_seqs(0) == 64
    raw["schedule"] = {"dispatch": "skew_aware", "long_tail": {"max_num_seqs": 4}}
    with pytest.raises(SpecError, match="set long_tail.engines too"):
        validate_spec(raw)
