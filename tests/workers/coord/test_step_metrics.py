"""Per-step measures of where a batch's time went: the long tail's share of generation and
the share of inference done beside generation (exact numbers)."""
import pytest

from workers.coord.step_metrics import inference_overlap, long_tail_share, percentile


def test_the_long_tail_share_is_the_time_after_nine_tenths_of_the_samples_finished():
    started = [0.0] * 10
    finished = [1, 1, 1, 1, 1, 1, 1, 1, 2, 10]  # the 9th (⌈0.9·10⌉) finished at 2, the last at 10
    assert long_tail_share(started, finished) == pytest.approx(0.8)
    assert long_tail_share([0.0, 0.0], [5.0, 5.0]) == 0.0  # no tail
    assert long_tail_share([], []) == 0.0


def test_inference_overlap_counts_only_inference_before_the_last_sample_finished_generating():
    generated = [1.0, 2.0, 4.0]  # the last sample finished generating at 4
    # fused: each sample's inference starts as it finishes: [1, 2] and [2, 3] before 4, [4, 5] after
    assert inference_overlap(generated, [1.0, 2.0, 4.0], [2.0, 3.0, 5.0]) == pytest.approx(2 / 3)
    assert inference_overlap(generated, [1.0, 2.0, 4.0], [4.5, 3.0, 5.0]) == pytest.approx(4 / 5.5)  # partly
    # a barrier: inference begins once the last finished, however early the others did
    assert inference_overlap(generated, [4.0, 4.0, 4.0], [4.5, 5.0, 5.5]) == 0.0
    assert inference_overlap(generated, [1.0, 2.0, 4.0], [1.0, 2.0, 4.0]) is None  # no inference time
    assert inference_overlap([], [], []) is None


def test_percentile_takes_the_nearest_rank():
    assert percentile([5, 1, 3, 2, 4], 0.99) == 5 and percentile([5, 1, 3, 2, 4], 0.5) == 3
