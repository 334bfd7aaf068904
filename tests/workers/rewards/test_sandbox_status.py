"""Whether reward code can be contained here, proven by a real sandbox or explained:
workers.rewards.sandbox.sandbox_status() and `python -m workers sandbox-check`. "Without
bubblewrap" is a PATH that really lacks bwrap."""
import os
import subprocess
import sys

from tests import sandbox_path
from tests.sandbox_path import MISSING
from workers.rewards.sandbox_boundary import UNSAFE_ENV, sandbox_status, uid_pool

# The sandbox fixtures, bound here so that pytest finds them: fresh_probe (autouse) for every
# test of this module, no_bwrap where a test names it.
fresh_probe, no_bwrap = sandbox_path.fresh_probe, sandbox_path.no_bwrap

POOL = f"{uid_pool().start}-{uid_pool().stop - 1}"  # 61000-61063 unless FLUXRL_SANDBOX_UID_BASE/COUNT say otherwise


def test_without_bubblewrap_the_check_says_what_is_missing_and_how_to_install_it(no_bwrap):
    available, reason = sandbox_status()
    assert available is False
    assert reason.startswith(MISSING)
    assert f"set {UNSAFE_ENV}=1" in reason


def test_with_bubblewrap_the_check_is_proven_by_a_real_contained_probe():
    assert sandbox_status() == (True, "proven: a contained probe ran in bubblewrap (namespaces, seccomp, rlimits) "
                                      f"as a uid of the pool {POOL}")


def test_a_failed_probe_is_reused_for_a_while_then_probed_again(monkeypatch, no_bwrap):
    assert sandbox_status()[0] is False
    monkeypatch.undo()  # bubblewrap "installed" (the real PATH back)
    assert sandbox_status()[0] is False  # within STATUS_TTL_S: the earlier answer, no new probe
    assert sandbox_status(max_age_s=0)[0] is True


def check(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers", "sandbox-check"], capture_output=True, text=True,
                          env={k: v for k, v in env.items() if k != UNSAFE_ENV}, timeout=60)


def test_sandbox_check_command_says_unavailable_and_why_without_bubblewrap(no_bwrap):
    out = check(dict(os.environ))
    assert out.returncode == 1, out.stderr
    assert out.stdout.startswith(f"sandbox: unavailable: {MISSING}")


def test_sandbox_check_command_says_proven_with_bubblewrap():
    out = check(dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert out.stdout == ("sandbox: proven: a contained probe ran in bubblewrap (namespaces, seccomp, rlimits) "
                          f"as a uid of the pool {POOL}\n")
