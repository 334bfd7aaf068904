"""The Reporter with the platform away (nothing listens on its port): points stay in a
bounded buffer, the oldest go first when it is full, with a warning, and metrics.jsonl
keeps everything. tests/platform/metrics/test_reporter_outage.py covers a real outage.

Its warnings are logged (workers.io.report); the engine CLI sends them to stderr, the run's
engine.log (the last test here)."""
import json
import subprocess
import sys
from pathlib import Path

from workers.io.ports import free_port
from workers.io.report import PlatformClient, Reporter


def unreachable_platform() -> PlatformClient:
    port = free_port("127.0.0.1")  # nobody listens there (and, below the ephemeral range, no retry self-connects)
    return PlatformClient(f"http://127.0.0.1:{port}", "flxr_test", 1, timeout=1)


def test_a_full_buffer_drops_the_oldest_points_with_a_warning_and_the_jsonl_keeps_them(tmp_path, caplog):
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

    err = caplog.text
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


class RecordingPlatform(PlatformClient):
    """Answers every post, keeping what was sent."""

    def __init__(self):
        super().__init__("http://127.0.0.1:9", "flxr_test", 1)
        self.posts = []

    def post(self, what, payload):
        self.posts.append((what, payload, len(json.dumps(payload))))
        return {}


def test_long_samples_with_their_tokens_go_in_batches_under_the_ingest_limit():
    platform = RecordingPlatform()
    reporter = Reporter(None, None)  # no thread: _ship is called here
    reporter.platform = platform
    tokens = ["tok"] * 15_000  # a 15k-token completion, one text per token
    for i in range(6):
        reporter.sample({"uid": f"s{i}", "step": i, "prompt": "p", "completion": "tok" * 15_000,
                         "versions": [1] * 15_000, "tokens": tokens})
    reporter.sample({"uid": "huge", "step": 9, "prompt": "p" * 700_000, "completion": "", "versions": []})
    for i in range(60):
        reporter.sample({"uid": f"t{i}", "step": 10, "prompt": "1+1=", "completion": "2", "versions": [1], "tokens": ["2"]})
    assert reporter._ship() and reporter.pending == (0, 0)
    sizes = [(len(payload["samples"]), size) for what, payload, size in platform.posts]
    assert [n for n, _ in sizes] == [2, 2, 2, 1, 50, 10]  # by bytes, then by count (SAMPLE_BATCH)
    assert all(size <= Reporter.SAMPLE_BATCH_BYTES for n, size in sizes if n > 1)
    assert [s["uid"] for _, payload, _ in platform.posts for s in payload["samples"]][:7] == \
        ["s0", "s1", "s2", "s3", "s4", "s5", "huge"]  # in order; one too large alone goes alone


def test_tokens_the_platform_would_refuse_are_left_out_not_the_sample(caplog):
    reporter = Reporter(None, None)
    reporter.platform = RecordingPlatform()
    good = {"uid": "a", "step": 1, "prompt": "p", "completion": "19", "versions": [1, 2], "tokens": ["1", "9"]}
    reporter.sample(good)
    reporter.sample({**good, "uid": "b", "tokens": ["19"]})  # not one per version
    reporter.sample({**good, "uid": "c", "tokens": ["1", "9" * 201]})
    reporter.sample({**good, "uid": "d", "tokens": None})
    assert [s.get("tokens") for s in reporter._samples] == [["1", "9"], None, None, None]
    assert all(s["versions"] == [1, 2] for s in reporter._samples)
    assert caplog.text.count("tokens") == 1  # warned once


def test_the_engine_cli_sends_the_warnings_to_stderr_with_their_level_and_logger():
    """Under the platform the engine's stderr is its engine.log, shown on the dashboard."""
    script = """
from workers.cli.engine import configure_logging
configure_logging()
from workers.io.ports import free_port
from workers.io.report import PlatformClient, Reporter
port = free_port("127.0.0.1")
reporter = Reporter(None, PlatformClient(f"http://127.0.0.1:{port}", "flxr_test", 1, timeout=1),
                    flush_every_s=0.05, close_timeout_s=0.2)
reporter.log(1, {"reward/mean": 1.0})
reporter.close()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr
    assert "WARNING workers.io.report: cannot reach the platform (" in done.stderr, done.stderr
    assert "WARNING workers.io.report: the platform stayed unreachable" in done.stderr, done.stderr
    assert done.stdout == ""
