"""Admission control (AReaL's bound) and per-token version bookkeeping."""
from types import SimpleNamespace

import pytest

from workers.rollout.engine_types import extend_track
from workers.rollout.staleness import StalenessGate, VersionTrack


def test_gate_admits_up_to_eta_plus_one_batches_ahead():
    gate = StalenessGate(batch_size=2, max_staleness=1)  # capacity (1 + 0 + 1) · 2 = 4
    assert [gate.start() for _ in range(4)] == [0, 0, 0, 0]
    assert not gate.can_start()
    gate.finish()
    gate.finish()
    assert not gate.can_start()  # 2 finished + 2 running = 4: still full until a step
    gate.advance()
    assert gate.capacity == 6
    assert gate.start() == 1 and gate.start() == 1
    assert not gate.can_start()
    with pytest.raises(RuntimeError, match="staleness"):
        gate.start()


def test_gate_with_zero_staleness_is_synchronous():
    gate = StalenessGate(batch_size=3, max_staleness=0)
    for _ in range(3):
        gate.start()
    assert not gate.can_start()
    for _ in range(3):
        gate.finish()
    assert not gate.can_start()  # nothing new until the step that uses them is done
    gate.advance()
    assert gate.can_start()


def test_a_rejected_unit_frees_its_slot():
    gate = StalenessGate(batch_size=1, max_staleness=0)
    gate.start()
    gate.finish(accepted=False)
    assert gate.can_start()


def test_version_track_merges_runs_and_measures_staleness():
    track = VersionTrack()
    track.add(0, 3)
    track.add(0, 2)
    track.add(1, 4)
    track.add(2, 0)  # nothing generated: no run
    assert track.runs == [[0, 5], [1, 4]]
    assert track.per_token() == [0] * 5 + [1] * 4
    assert (track.tokens, track.oldest, track.newest) == (9, 0, 1)
    assert track.staleness(trainer_version=3) == 3


def _span(version, start, end):
    return SimpleNamespace(version=str(version), start=start, end=end)


def test_sequence_spanning_an_in_flight_update_records_both_versions():
    track = VersionTrack()
    # one request: 4 tokens under version 2, then the weights changed, 6 under version 3
    extend_track(track, [_span(2, 0, 4), _span(3, 4, 10)], produced=10, fallback_version=0)
    assert track.runs == [[2, 4], [3, 6]]


def test_interrupted_sequence_keeps_its_prefix_versions_and_continues_under_new_ones():
    track = VersionTrack()
    extend_track(track, None, produced=7, fallback_version=5)  # aborted: no spans reported
    extend_track(track, [_span(6, 0, 3)], produced=10, fallback_version=6)  # resubmitted with the prefix
    assert track.runs == [[5, 7], [6, 3]]
    assert track.per_token()[6:8] == [5, 6]


def test_a_dropped_stale_unit_gives_its_slot_back():
    gate = StalenessGate(batch_size=1, max_staleness=1)
    gate.start()
    gate.start()
    gate.finish()
    gate.finish()
    assert not gate.can_start()
    gate.release()  # one of them was too stale to train on
    assert gate.can_start()
