"""User reward code runs in a limited child process: each escape attempt fails with a
clear error, and the calling process survives."""
import os

import pytest

from workers.rewards.service import RewardFunctionBroken, RewardService
from workers.rewards.sandbox import RewardCodeError, RewardSandbox, try_reward
from workers.spec import RewardSpec

ROW = [{"prompt": "1+2=", "completion": "3", "fields": {"answer": "3"}}]


def _try(code, timeout_s=1.0):
    return try_reward("def reward(prompt, completion, **fields):\n" + code, ROW, timeout_s=timeout_s)


def test_correct_code_scores():
    out = try_reward("def reward(prompt, completion, answer='', **f):\n    return float(completion == answer)", ROW * 2)
    assert out["ok"] and [r["reward"] for r in out["results"]] == [1.0, 1.0]


@pytest.mark.parametrize("body, error", [
    ("    raise ValueError('boom')", "ValueError: boom (line 2)"),
    ("    while True: pass", "timed out after 1s"),
    ("    x = []\n    while True: x.append(' ' * 10**7)", "MemoryError"),
    ("    import socket\n    socket.create_connection(('127.0.0.1', 5432))", "socket"),
    ("    import os\n    os.fork()", "os.fork is not allowed"),
    ("    import subprocess\n    subprocess.run(['ls'])", "importing _posixsubprocess is not allowed"),
    ("    open('/tmp/fluxrl-escape', 'w').write('x')", "writing /tmp/fluxrl-escape is not allowed"),
    ("    return float(len(open('/etc/passwd').read()))", "reading /etc/passwd is not allowed"),
    ("    return float('nan')", "finite number"),
])
def test_hostile_or_broken_code_gets_a_clear_error(body, error):
    out = _try(body)
    assert not out["ok"]
    assert error in out["results"][0]["error"]
    assert not os.path.exists("/tmp/fluxrl-escape")


SECRETS = {"DJANGO_SECRET_KEY": "top-secret", "SECRET_KEY": "top-secret", "DATABASE_URL": "postgres://u:pw@db/x",
           "REDIS_URL": "redis://:pw@r/0", "FLUXRL_RUN_TOKEN": "flxr_secret", "FLUXRL_API_TOKEN": "flxu_secret"}


def test_platform_secrets_are_not_in_the_environment(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    code = ("def reward(prompt, completion, **fields):\n    import os\n"
            "    assert not set(os.environ) - {'PATH', 'HOME', 'LANG', 'PYTHONDONTWRITEBYTECODE', 'PWD', 'TMPDIR'}, sorted(os.environ)\n"
            "    assert not any(v in str(os.environ) for v in fields['secrets'])\n    return 1.0")
    out = try_reward(code, [{"prompt": "p", "completion": "c", "fields": {"secrets": list(SECRETS.values())}}])
    assert out["ok"], out


@pytest.mark.parametrize("body, error", [
    # the parent's environment, through /proc
    ("    import os\n    open(f'/proc/{os.getppid()}/environ', 'rb').read()", "reading /proc/"),
    ("    open('/proc/1/environ', 'rb').read()", "reading /proc/1/environ is not allowed"),
    # the network, any family
    ("    import socket\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM)", "socket.__new__ is not allowed"),
    ("    import socket\n    socket.socket(socket.AF_UNIX).connect('/var/run/postgresql/.s.PGSQL.5432')", "socket.__new__"),
    ("    import _socket\n    _socket.socket()", "socket.__new__ is not allowed"),
    # other processes
    ("    import _posixsubprocess", "importing _posixsubprocess is not allowed"),
    ("    import ctypes", "importing ctypes is not allowed"),
    ("    import os\n    os.posix_spawn('/bin/true', ['true'], {})", "os.posix_spawn is not allowed"),
    ("    import os, signal\n    os.kill(os.getppid(), signal.SIGTERM)", "os.kill is not allowed"),
    # the file system outside its folder
    ("    import os\n    os.mkdir('/tmp/fluxrl-escape-dir')", "os.mkdir outside the working folder"),
    ("    import os\n    os.truncate(os.environ['HOME'] + '/../victim', 0)", "os.truncate outside the working folder"),
    ("    import os\n    os.utime('/tmp', (0, 0))", "os.utime outside the working folder"),
    ("    import os\n    os.mkfifo('/tmp/fluxrl-escape-fifo')", "has no attribute 'mkfifo'"),
    ("    import os\n    os.listdir('/')", "listing / is not allowed"),
    ("    import os, sys\n    fd = os.open(sys.prefix, os.O_RDONLY)\n    os.open('x', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
     "opening the folder"),
    ("    import os\n    os.mkdir('x', dir_fd=0)", "os.mkdir outside the working folder"),
    # resources
    ("    return float(len(bytearray(10**10)))", "MemoryError"),
    ("    open('big', 'wb').write(b'x' * (5 << 20))", "File too large"),
])
def test_escape_attempts_are_refused_by_name(body, error, tmp_path):
    out = _try(body)
    assert not out["ok"] and error in out["results"][0]["error"], out
    assert not os.path.exists("/tmp/fluxrl-escape-dir") and not os.path.exists("/tmp/fluxrl-escape-fifo")


def test_code_may_write_read_and_list_inside_its_own_folder_which_goes_away():
    code = ("def reward(prompt, completion, **fields):\n    import os\n    os.makedirs('sub', exist_ok=True)\n"
            "    open('sub/a.txt', 'w').write('hi')\n    return float(len(open('sub/a.txt').read()) + len(os.listdir('.')))\n")
    with RewardSandbox(code) as box:
        folder = box._child._dir  # None under the OS sandbox: the folder is a tmpfs inside it
        result = box.score("p", "c")
    assert (result.reward, result.error) == (3.0, None)
    assert folder is None or not os.path.exists(folder)
    with RewardSandbox("def reward(prompt, completion, **fields):\n    import os\n    return float(len(os.listdir('.')))\n") as box:
        assert box.score("p", "c").reward == 0.0  # the next sandbox starts empty


def test_an_endless_loop_while_loading_is_stopped_by_the_cpu_limit():
    out = try_reward("while True:\n    pass\n", ROW, timeout_s=1.0)
    assert not out["ok"] and "did not start" in out["error"]


def test_code_that_does_not_define_reward_is_refused_up_front():
    with pytest.raises(RewardCodeError, match="must define a function reward"):
        RewardSandbox("x = 1").start()
    assert try_reward("def reward(:", ROW)["error"].startswith("SyntaxError")


def test_sandbox_recovers_after_a_timeout():
    code = "def reward(prompt, completion, **f):\n    while completion == 'loop': pass\n    return 1.0"
    with RewardSandbox(code, timeout_s=0.5) as box:
        assert box.score("p", "loop").error.startswith("timed out")
        assert box.score("p", "fine").reward == 1.0


def test_reward_service_marks_failing_samples_and_stops_on_a_broken_function():
    service = RewardService(RewardSpec(function="user", code="def reward(p, c, **f):\n    raise KeyError('answer')"),
                            fail_fast_after=3)
    try:
        first = service.score_sync("p", "c", {})
        assert first.reward == 0.0 and "KeyError" in first.error
        service.score_sync("p", "c", {})
        with pytest.raises(RewardFunctionBroken, match="failed on all of the first 3 samples"):
            service.score_sync("p", "c", {})
    finally:
        service.close()


def test_reward_service_rejects_unknown_builtin():
    with pytest.raises(ValueError, match="not a built-in"):
        RewardService(RewardSpec(function="nope"))


def test_fused_scoring_gives_exactly_the_rewards_of_scoring_after_a_barrier():
    """Per-sample scoring while generation runs (concurrent, in completion order) must
    equal scoring the whole batch afterwards in batch order."""
    import asyncio

    code = "def reward(prompt, completion, answer='', **f):\n    return len(completion) * 0.5 + (completion == answer)"
    rows = [(f"{i}+1=", str((i * 7) % 13), {"answer": str(i + 1)}) for i in range(24)]
    service = RewardService(RewardSpec(function="user", code=code))
    try:
        barrier = [service.score_sync(p, c, f).reward for p, c, f in rows]

        async def fused():
            async def one(k):
                await asyncio.sleep((24 - k) * 0.001)  # finish in reverse order
                return (await service.score(*rows[k])).reward
            return await asyncio.gather(*(one(k) for k in range(24)))

        assert asyncio.run(fused()) == barrier
    finally:
        service.close()
