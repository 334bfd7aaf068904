"""The Reporter with the platform away (nothing listens on its port): points stay in a
bounded buffer, the oldest go first when it is full, with a warning, and metrics.jsonl
keeps everything. tests/platform/metrics/test_reporter_outage.py covers a real outage."""
import json
import socket

from workers.report import PlatformClient, Reporter


def unreachable_platform() -> PlatformClient:
    with socket.socket() as s:  # a port nobody listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return PlatformClient(f"http://127.0.0.1:{port}", "flxr_test", 1, timeout=1)


def test_a_full_buffer_drops_the_oldest_points_with_a_warning_and_the_jsonl_keeps_them(tmp_path, capfd):
    reporter = Reporter(tmp_path / "metrics.jsonl", unreachable_platform(), flush_every_s=0.05,
                        max_points=50, max_samples=3, close_timeout_s=0.3)
    for step in range(40):
        reporter.log(step, {"reward/mean": step, "loss/policy": -step})
    for step in range(5):
        reporter.sample({"uid": f"s{step}", "step": step})

    assert reporter.pending == (50, 3)
    assert (reporter.dropped_points, reporter.dropped_samples) == (30, 2)
    assert [p["step"] for p in list(reporter._points)[:2]] == [15, 15]  # the newest are kept
    reporter.close()

    err = capfd.readouterr().err
    assert err.count("report buffer is full") == 1, err  # one warning, not one per point
    assert "50 points and 3 samples were not sent" in err
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 80 and json.loads(lines[0])["step"] == 0


def test_retries_back_off_up_to_the_cap(tmp_path):
    reporter = Reporter(None, None, flush_every_s=0.5, max_backoff_s=10)
    delays = []
    for streak in range(1, 10):
        reporter._streak = streak
        delays.append(reporter._backoff())
    assert 0.5 <= delays[0] <= 1.0 and all(d <= 10 for d in delays) and delays[-1] >= 5
