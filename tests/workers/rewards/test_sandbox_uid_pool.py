"""Each reward sandbox runs as a uid of its own from a pool (workers.rewards.sandbox.lease_uid), so
one team's code holding its RLIMIT_NPROC cannot stop another team's sandbox from starting
or scoring. Real sandboxes and processes; the uid is what the code inside reports."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from workers.rewards import sandbox_boundary
from workers.rewards.sandbox import RewardCodeError, RewardSandbox
from workers.rewards.sandbox_boundary import MAX_PROCESSES, UNSAFE_ENV, boundary, uid_pool

# Starts threads (tasks of its uid, as RLIMIT_NPROC counts them) until the limit refuses one;
# they stay alive after reward() returns, as long as the sandbox does.
HOG = textwrap.dedent("""
    import threading
    stop = threading.Event()
    def reward(prompt, completion, **fields):
        threading.stack_size(65536)  # small stacks: the process limit, not the memory limit, must stop it
        n = 0
        try:
            while True:
                threading.Thread(target=stop.wait, daemon=True).start()
                n += 1
        except RuntimeError:
            return float(n)
""")
# A well-behaved reward that needs one thread; reports the uid it runs as.
WHO = textwrap.dedent("""
    import os, threading
    def reward(prompt, completion, **fields):
        seen = []
        worker = threading.Thread(target=lambda: seen.append(float(os.getuid())))
        worker.start()
        worker.join()
        return seen[0]
""")


@pytest.fixture(autouse=True)
def os_boundary():
    if os.environ.get(UNSAFE_ENV) == "1":
        pytest.skip(f"{UNSAFE_ENV}=1: no OS sandbox, no uid of its own")
    assert boundary().kind == "bwrap"


def tasks_of(uid: int) -> int:
    """Tasks (threads included) the host runs as ``uid``: what RLIMIT_NPROC counts."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
        except (OSError, ValueError):
            continue
        if int(status["Uid"].split()[0]) == uid:
            total += int(status["Threads"])
    return total


def test_a_sandbox_holding_its_process_limit_does_not_stop_another_from_starting_or_scoring():
    hogs = [RewardSandbox(HOG, timeout_s=20, cpu_s=30) for _ in range(2)]
    try:
        for hog in hogs:
            started = hog.score("p", "c")
            assert started.error is None and started.reward == MAX_PROCESSES - 1, started  # + its main thread
            assert tasks_of(hog.uid) == MAX_PROCESSES  # held at the limit while the sandbox lives
        # Two sandboxes at the limit: with one shared uid, a third could not even start.
        with RewardSandbox(WHO, timeout_s=5) as other:
            result = other.score("p", "c")
            assert result.error is None, result
            assert result.reward == other.uid
            assert int(result.reward) not in {hog.uid for hog in hogs}
    finally:
        for hog in hogs:
            hog.close()


def test_concurrent_sandboxes_of_this_and_another_process_get_different_uids():
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from workers.rewards.sandbox import RewardSandbox
            with RewardSandbox({WHO!r}) as box:
                print(int(box.score("p", "c").reward), flush=True)
                sys.stdin.readline()  # holds its sandbox until told
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        other_process_uid = int(holder.stdout.readline())
        with RewardSandbox(WHO) as first, RewardSandbox(WHO) as second:
            uids = [other_process_uid, int(first.score("p", "c").reward), int(second.score("p", "c").reward)]
    finally:
        holder.communicate("\n", timeout=30)
    assert len(set(uids)) == 3, uids
    assert all(uid in uid_pool() and uid != 0 for uid in uids)


def test_a_full_pool_makes_a_new_sandbox_wait_then_names_the_setting(monkeypatch):
    monkeypatch.setenv("FLUXRL_SANDBOX_UID_BASE", "62000")  # a pool of its own, of one uid
    monkeypatch.setenv("FLUXRL_SANDBOX_UID_COUNT", "1")
    monkeypatch.setattr(sandbox_boundary, "UID_WAIT_S", 0.5)
    with RewardSandbox(WHO) as first:
        assert first.score("p", "c").reward == 62000.0
        t0 = time.monotonic()
        with pytest.raises(RewardCodeError, match=r"all 1 sandbox uids \(62000-62000\) are in use on this host: "
                                                  r"too many reward sandboxes at once; raise FLUXRL_SANDBOX_UID_COUNT"):
            RewardSandbox(WHO).start()
        assert 0.5 <= time.monotonic() - t0 < 5
    with RewardSandbox(WHO) as after:  # released when the first closed
        assert after.score("p", "c").reward == 62000.0
