"""Dispatch policies: exact orders and engine assignments."""
import pytest

from workers.coord.scheduling import DispatchWindow, EngineLoads, dispatch_order, least_loaded, plan_dispatch, plan_tail_migration

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
