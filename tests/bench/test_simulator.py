"""The discrete-event simulator (bench/simulator/): sanity of the modes, skew-aware
dispatch, staleness handling, calibration and the SVG plot."""
import math
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest

from bench.simulator.calibration import calibrate, cpu_prediction
from bench.simulator.cli import parse_gpus
from bench.simulator.model import (
    MODES, Costs, Setup, Workload, cluster_costs, compare, lognormal_lengths, planned_resources, recommend, simulate,
)
from bench.simulator.plot import Panel, Series, nice_ticks, split_plot, svg_chart

COSTS = Costs(decode_step_s=0.01, decode_per_seq_s=2e-4, prefill_per_token_s=1e-5, train_per_token_s=2e-4,
              train_step_s=0.2, sync_s=0.1, load_s=0.05, max_seqs=64)
LONG_TAILED = Workload(lengths=lognormal_lengths(60, 1.0, 1500), prompt_tokens=20, group_size=4, batch_prompts=16,
                       micro_batch_tokens=2000)
SAME_LENGTH = replace(LONG_TAILED, lengths=(120,) * 50)


def test_stream_beats_sync_and_async_beats_stream_on_a_long_tail():
    r = compare(COSTS, LONG_TAILED, engines=4, steps=8)
    assert r["sync"].samples_per_s < r["stream"].samples_per_s < r["async"].samples_per_s
    assert r["async"].staleness_mean > 0 == r["sync"].staleness_mean


def test_idle_fractions_are_shares():
    for result in compare(COSTS, LONG_TAILED, engines=4, steps=6).values():
        assert 0.0 <= result.gen_idle <= 1.0 and 0.0 <= result.train_idle <= 1.0
        assert result.samples_per_s > 0 and result.steps == 6


def test_sync_leaves_generation_idle_while_training():
    r = simulate(COSTS, LONG_TAILED, Setup(engines=4, mode="sync", steps=6))
    assert r.gen_idle > 0.3 and r.train_idle > 0.3


def test_without_length_spread_skew_aware_dispatch_changes_nothing():
    r = compare(COSTS, SAME_LENGTH, engines=4, steps=6)
    assert r["stream+skew"] == r["stream"]
    assert r["async+skew"] == r["async"]


def test_longest_first_shortens_a_queue_bound_synchronous_step():
    # 2 engines × 2 slots for 16 single samples: a long one dispatched late waits in the queue
    queued = replace(COSTS, max_seqs=2)
    work = replace(LONG_TAILED, group_size=1)
    fifo = simulate(queued, work, Setup(engines=2, mode="sync", steps=6))
    skew = simulate(queued, work, Setup(engines=2, mode="sync", skew=True, predictor_corr=1.0, steps=6))
    assert skew.samples_per_s > 1.1 * fifo.samples_per_s


def test_same_seed_same_result():
    a = simulate(COSTS, LONG_TAILED, Setup(engines=3, mode="async", skew=True, steps=5, seed=4))
    assert a == simulate(COSTS, LONG_TAILED, Setup(engines=3, mode="async", skew=True, steps=5, seed=4))


def test_dropping_stale_groups_without_freeing_their_slots_loses_the_async_lead():
    # A fast trainer leaves long groups behind. The controller's rule (drop, keep the
    # slot) shrinks the admission lead by one group per drop until η·B are gone and
    # nothing can go stale any more: async then runs with no lead at all.
    fast_trainer = replace(COSTS, train_per_token_s=2e-5, train_step_s=0.01)
    base = Setup(engines=2, mode="async", max_staleness=2, steps=40, warmup_steps=10)
    freeing = simulate(fast_trainer, LONG_TAILED, replace(base, stale_groups="drop"))
    keeping = simulate(fast_trainer, LONG_TAILED, replace(base, stale_groups="drop_keep_slot"))
    assert keeping.dropped_groups <= 2 * LONG_TAILED.batch_prompts < freeing.dropped_groups
    assert keeping.samples_per_s < 0.6 * freeing.samples_per_s


@pytest.mark.parametrize("mode", ["keep", "interrupt", "drain"])
def test_update_modes_run(mode):
    r = simulate(COSTS, LONG_TAILED, Setup(engines=2, mode="async", update_mode=mode, steps=5))
    assert r.samples_per_s > 0


def test_calibration_reproduces_the_measurements_it_is_fitted_to():
    runs = [{"mode": m, "len_mean": 6.0, "len_p99": 24, "sync_ms": 40.0, "load_ms": 15.0} for m in ("sync", "keep")]
    for r in runs:
        r["samples_per_s"] = cpu_prediction(r, gen_scale=3.0, train_per_token_s=4e-4, steps=6)
    fit = calibrate(runs, points=3, tol=0.02, steps=6)
    assert fit["rms_log_error"] < 0.03
    for row in fit["runs"]:
        assert row["predicted"] == pytest.approx(row["measured"], rel=0.05)


def test_cluster_costs_follow_the_model_size():
    work = Workload(lengths=(1000,), prompt_tokens=200)
    small, engines = cluster_costs(7e9, 8, 8, work)
    assert engines == 8  # 14 GB of weights fit one 80 GB GPU
    big, big_engines = cluster_costs(70e9, 8, 24, work)
    assert big_engines == 2  # 140 GB: tensor parallel 4
    assert big.train_per_token_s / small.train_per_token_s == pytest.approx(10 * 8 / 24)
    assert cluster_costs(70e9, 8, 8, work) is None  # 70B × 18 bytes does not fit 8 trainer GPUs


def test_recommend_reports_every_mode_and_a_best_split():
    work = Workload(lengths=lognormal_lengths(200, 1.0, 4000, n=500), prompt_tokens=100, group_size=4, batch_prompts=8)
    (row,) = recommend(7e9, [4], work, {"steps": 4, "warmup_steps": 1})
    assert set(row["best"]) == set(MODES)
    assert [r for r, _ in row["curves"]["async"]] == [1, 2]  # 7B needs 2 trainer GPUs: not 3/1
    assert row["colocated_sync"].samples_per_s > 0
    svg = split_plot(7e9, [row], focus_gpus=4)
    ET.fromstring(svg)  # well-formed


def test_gpu_ranges():
    assert parse_gpus("8..64") == [8, 16, 32, 64]
    assert parse_gpus("8,24") == [8, 24] and parse_gpus("64") == [64]


def test_nice_ticks_cover_the_range_with_round_steps():
    assert nice_ticks(0.0, 0.9) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0.0, 137.0) == [0.0, 20.0, 40.0, 60.0, 80.0, 100.0, 120.0, 140.0]


def test_svg_chart_is_well_formed_and_escapes_labels():
    svg = svg_chart([Panel("a < b", "x", "y", [Series("s & t", [0, 1, 2], [1, 3, 2], "#000", mark=1)])], "title")
    root = ET.fromstring(svg)
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "a < b" in texts and "s & t" in texts
    assert not math.isnan(float(root.get("width")))


@pytest.mark.parametrize("gpus", [8, 16, 64, 256])
def test_the_recommended_split_is_one_the_placement_planner_lays_out(gpus):
    from workers.cluster.placement import Machine, plan_placement
    from workers.spec import validate_spec

    work = Workload(lengths=lognormal_lengths(200, 1.0, 4000, n=300), prompt_tokens=100, group_size=4,
                    batch_prompts=8)
    (row,) = recommend(7e9, [gpus], work, {"steps": 3, "warmup_steps": 1})
    _, (rollout, _) = max(((m, rc) for m, c in row["curves"].items() for rc in c),
                          key=lambda mrc: mrc[1][1].samples_per_s)
    planned = planned_resources(7e9, gpus, rollout, work)
    spec = validate_spec({"name": "p", "model": {"path": "m"}, "task": {"dataset": "gen:add"}, **planned})
    plan = plan_placement(spec, Machine(cpu_cores=64, gpus_per_node=min(gpus, 8), gpu_memory_gib=80))
    assert len(plan.trainers) + len(plan.engines) * spec.resources.tensor_parallel == gpus
    assert len(plan.engines) * spec.resources.tensor_parallel == rollout and plan.nodes == max(1, gpus // 8)
