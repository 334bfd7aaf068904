"""Red team for the reward sandbox: attacks that first switch off the interpreter-level
guard (the audit hook, by swapping its code object), then try to get out. What must hold
them is the operating system: namespaces, another user, seccomp and rlimits.

These tests fail (they do not skip) where the boundary cannot be built: a platform that
cannot contain reward code must be told so, not pass its tests.
"""
import json
import os
import socket
import subprocess
import textwrap
import uuid

import pytest

from workers.rewards.sandbox import RewardSandbox
from workers.rewards.sandbox_boundary import UNSAFE_ENV, WORKDIR_MB, boundary, uid_pool

# Switches the audit hook off: every test below runs with no Python-level guard at all.
_DISARM = """
import sys
sys.modules["__main__"].hook.__code__ = (lambda event, args: None).__code__
"""


@pytest.fixture(scope="module", autouse=True)
def os_boundary():
    if os.environ.get(UNSAFE_ENV) == "1":
        pytest.skip(f"{UNSAFE_ENV}=1: the operator chose to run reward code without the OS sandbox")
    assert boundary().kind == "bwrap"


def attack(body: str, timeout_s: float = 20.0, memory_mb: int = 512) -> dict:
    """Run ``body`` (the inside of a function that returns a JSON-able dict) in a sandbox
    whose audit hook has been disarmed; return what it reported."""
    code = _DISARM + "def attack():\n" + textwrap.indent(textwrap.dedent(body), "    ") + textwrap.dedent("""
        import json
        def reward(prompt, completion, **fields):
            raise RuntimeError("RESULT:" + json.dumps(attack()) + ":END")
        """)
    with RewardSandbox(code, timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=60) as box:
        result = box.score("p", "c")
    assert result.error and "RESULT:" in result.error, result
    return json.loads(result.error.split("RESULT:", 1)[1].rsplit(":END", 1)[0])


def _errno_of(name: str):
    import errno

    return getattr(errno, name)


# -- the guard really is off ---------------------------------------------------------
def test_the_disarmed_hook_lets_everything_through_at_the_python_level():
    out = attack("""
        import os, ctypes, socket
        return {"uid": os.getuid(), "ctypes": hasattr(ctypes, "CDLL"), "listed": sorted(os.listdir("/"))}
    """)
    assert out["ctypes"] is True  # ctypes was refused by the hook; now it imports
    assert out["uid"] in uid_pool()


# -- who it runs as -----------------------------------------------------------------
def test_runs_as_an_unprivileged_user_with_no_capabilities():
    out = attack("""
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        import os
        return {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
                "caps": [status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")],
                "nnp": status["NoNewPrivs"].strip(), "seccomp": status["Seccomp"].strip()}
    """)
    assert out["uid"] == out["euid"] != 0 and out["uid"] in uid_pool()  # a uid of the sandbox pool
    assert out["gid"] == out["uid"] and out["groups"] in ([], [out["uid"]])
    assert all(int(mask, 16) == 0 for mask in out["caps"]), out["caps"]
    assert out["nnp"] == "1" and out["seccomp"] == "2"  # no privilege gain by exec; filter mode


# -- the filesystem ------------------------------------------------------------------
def test_host_files_do_not_exist_inside(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("platform secret")
    repo = os.path.realpath(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    out = attack(f"""
        import os
        found = {{}}
        for path in ["/etc/shadow", "/etc/passwd", "/root/.ssh", "/home", {str(secret)!r}, {repo!r},
                     {os.path.join(repo, "pyproject.toml")!r}, "/var/run/postgresql", "/tmp", "/data"]:
            found[path] = os.path.exists(path)
        return {{"found": found, "top": sorted(os.listdir("/"))}}
    """)
    assert not any(out["found"].values()), out["found"]
    assert not {"home", "etc_shadow", "var", "srv", "opt", "mnt", "tmp"} & set(out["top"]), out["top"]


def test_the_python_installation_and_usr_are_read_only():
    out = attack("""
        import os, sys
        results = {}
        for path in ["/usr/evil", os.path.join(sys.base_prefix, "evil"), "/evil"]:
            try:
                open(path, "w").write("x")
                results[path] = "written"
            except OSError as exc:
                results[path] = exc.errno
        return results
    """)
    assert "written" not in out.values(), out


def test_links_cannot_reach_outside_the_sandbox():
    out = attack("""
        import os
        os.symlink("/etc/shadow", "link")
        results = {"symlink_read": os.path.exists("link")}
        try:
            os.link("/usr/bin/env", "hard")
            results["hardlink"] = "made"
        except OSError as exc:
            results["hardlink"] = exc.errno
        import ctypes  # the sandbox takes os.mknod away; the libc call remains
        libc = ctypes.CDLL(None, use_errno=True)
        made = libc.mknodat(-100, b"dev", 0o020600, (1 << 8) | 3)  # AT_FDCWD, char device 1:3
        results["mknod"] = "made" if made == 0 else ctypes.get_errno()
        return results
    """)
    assert out["symlink_read"] is False
    assert out["hardlink"] != "made" and out["mknod"] != "made", out


def test_the_working_folder_is_small_and_filling_it_touches_no_host_disk():
    out = attack("""
        import os
        written, stop = 0, None
        try:
            for i in range(64):
                with open(f"f{i}", "wb") as f:
                    for _ in range(4):
                        f.write(b"x" * (256 << 10))
                        f.flush()
                        written += 256 << 10
        except OSError as exc:
            stop = exc.errno
        big = None
        try:
            open("big", "wb").write(b"y" * (2 << 20))  # over the 1 MB file-size limit
        except OSError as exc:
            big = exc.errno
        return {"written": written, "stop": stop, "big": big}
    """)
    assert out["stop"] == _errno_of("ENOSPC") and out["written"] <= WORKDIR_MB << 20, out
    assert out["big"] is not None


# -- processes ---------------------------------------------------------------------
def test_no_process_can_be_started_by_any_route():
    out = attack("""
        import os, subprocess, ctypes, platform
        results = {}
        def attempt(name, fn):
            try:
                results[name] = repr(fn())
            except OSError as exc:
                results[name] = exc.errno
            except Exception as exc:
                results[name] = type(exc).__name__
        touch = ["/usr/bin/touch", "/work/proof"]  # evidence, had any of them run
        attempt("fork", os.fork)
        attempt("system", lambda: os.system(" ".join(touch)))
        attempt("subprocess", lambda: subprocess.run(touch).returncode)
        attempt("posix_spawn", lambda: os.waitpid(os.posix_spawn(touch[0], touch, {}), 0))
        libc = ctypes.CDLL(None, use_errno=True)
        def raw(number, *args):
            value = libc.syscall(number, *args)
            return value if value != -1 else -ctypes.get_errno()
        if platform.machine() == "x86_64":
            results["sys_fork"] = raw(57)
            results["sys_vfork"] = raw(58)
            results["sys_clone"] = raw(56, 17, 0, 0, 0, 0)  # SIGCHLD: a process, not a thread
            results["sys_clone3"] = raw(435, 0, 0)
        elif platform.machine() == "aarch64":
            results["sys_clone"] = raw(220, 17, 0, 0, 0, 0)
            results["sys_clone3"] = raw(435, 0, 0)
        results["proof"] = os.path.exists("/work/proof")
        return results
    """)
    import errno

    assert out["proof"] is False, out
    assert out["fork"] == errno.EPERM, out
    for route in ("sys_fork", "sys_vfork", "sys_clone"):
        if route in out:
            assert out[route] == -errno.EPERM, (route, out)
    if "sys_clone3" in out:
        assert out["sys_clone3"] == -errno.ENOSYS


def test_exec_is_refused_and_the_process_lives_on():
    out = attack("""
        import os
        try:
            os.execv("/usr/bin/env", ["env"])
        except OSError as exc:
            return {"exec": exc.errno}
        return {"exec": "replaced"}
    """)
    import errno

    assert out["exec"] == errno.EPERM


def test_threads_work_but_a_thread_bomb_stops_at_the_process_limit():
    out = attack("""
        import threading, time
        stop = threading.Event()
        started, error = 0, None
        try:
            for _ in range(500):
                t = threading.Thread(target=stop.wait, daemon=True)
                t.start()
                started += 1
        except RuntimeError as exc:
            error = str(exc)
        stop.set()
        return {"started": started, "error": error}
    """)
    assert 1 <= out["started"] < 100 and out["error"], out


def test_a_memory_bomb_gets_a_memory_error_not_the_host():
    out = attack("""
        try:
            hog = bytearray(4 << 30)
            return {"allocated": len(hog)}
        except MemoryError:
            return {"allocated": 0}
    """, memory_mb=256)
    assert out["allocated"] == 0


def test_host_processes_cannot_be_seen_or_signalled():
    victim = subprocess.Popen(["sleep", "60"])
    try:
        out = attack(f"""
            import os, signal
            pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
            results = {{"pids": pids, "ppid": os.getppid()}}
            for name, target in [("victim", {victim.pid}), ("parent", os.getppid()), ("init", 1)]:
                try:
                    os.kill(target, signal.SIGKILL)
                    results[name] = "sent"
                except OSError as exc:
                    results[name] = exc.errno
            try:
                os.kill(-1, signal.SIGKILL)  # everything it may signal; must not include itself first
            except OSError as exc:
                results["all"] = exc.errno
            return results
        """)
        assert victim.poll() is None, "a host process was killed from inside the sandbox"
        assert len(out["pids"]) <= 3 and victim.pid not in out["pids"] or out["victim"] != "sent", out
        assert os.getpid() not in out["pids"] or len(out["pids"]) <= 3
    finally:
        victim.kill()
        victim.wait()


# -- the network -------------------------------------------------------------------
def test_no_network_of_any_family():
    out = attack("""
        import socket
        results = {}
        for name, family, kind in [("inet", socket.AF_INET, socket.SOCK_STREAM), ("inet6", socket.AF_INET6, socket.SOCK_STREAM),
                                   ("udp", socket.AF_INET, socket.SOCK_DGRAM), ("netlink", socket.AF_NETLINK, socket.SOCK_RAW),
                                   ("packet", 17, socket.SOCK_RAW)]:
            try:
                socket.socket(family, kind).close()
                results[name] = "opened"
            except OSError as exc:
                results[name] = exc.errno
        return results
    """)
    assert "opened" not in out.values(), out


def test_unix_sockets_cannot_reach_host_services():
    name = f"fluxrl-redteam-{uuid.uuid4().hex}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)  # an abstract socket: scoped by the network namespace
    listener.listen(1)
    try:
        out = attack(f"""
            import socket
            results = {{}}
            for label, address in [("abstract", "\\0{name}"), ("postgres", "/var/run/postgresql/.s.PGSQL.5432"),
                                   ("docker", "/var/run/docker.sock")]:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(address)
                    results[label] = "connected"
                except OSError as exc:
                    results[label] = exc.errno
                finally:
                    s.close()
            return results
        """)
    finally:
        listener.close()
    assert "connected" not in out.values(), out


# -- the kernel's sharper edges ----------------------------------------------------
def test_namespace_mount_trace_and_kernel_interfaces_are_refused():
    out = attack("""
        import ctypes, os, platform
        libc = ctypes.CDLL(None, use_errno=True)
        def call(fn, *args):
            value = fn(*args)
            return value if value != -1 else -ctypes.get_errno()
        results = {
            "unshare_user": call(libc.unshare, 0x10000000),
            "unshare_net": call(libc.unshare, 0x40000000),
            "mount": call(libc.mount, b"none", b"/work", b"tmpfs", 0, None),
            "chroot": call(libc.chroot, b"/work"),
            "ptrace": call(libc.ptrace, 16, 1, 0, 0),  # PTRACE_ATTACH to pid 1
        }
        fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        results["setns"] = call(libc.setns, fd, 0)
        numbers = {"x86_64": {"bpf": 321, "io_uring_setup": 425, "keyctl": 250, "perf_event_open": 298,
                              "process_vm_readv": 310, "userfaultfd": 323},
                   "aarch64": {"bpf": 280, "io_uring_setup": 425, "keyctl": 219, "perf_event_open": 241,
                               "process_vm_readv": 270, "userfaultfd": 282}}.get(platform.machine(), {})
        buf = ctypes.create_string_buffer(256)
        for name, number in numbers.items():
            results[name] = call(libc.syscall, number, 0, ctypes.addressof(buf), 0, 0, 0)
        return results
    """)
    import errno

    assert all(value in (-errno.EPERM, -errno.ENOSYS) for value in out.values()), out


def test_no_descriptor_of_the_parent_is_inherited():
    out = attack("""
        import os
        fds = {}
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        return fds
    """)
    extra = {fd: target for fd, target in out.items() if int(fd) > 2 and "/proc/" not in target}
    assert not extra, out


# -- the interpreter's own state --------------------------------------------------
def test_rewriting_frames_builtins_and_the_import_system_reaches_nothing_more(tmp_path):
    secret = tmp_path / "key"
    secret.write_text("platform secret")
    out = attack(f"""
        import sys, gc, builtins, importlib
        results = {{}}
        # Frames: climb to the sandbox's own loop and read its globals.
        frame = sys._getframe()
        while frame.f_back is not None:
            frame = frame.f_back
        results["main_globals"] = "hook" in frame.f_globals
        # gc: every live function, including the guard, is within reach.
        results["functions_seen"] = sum(1 for o in gc.get_objects() if type(o).__name__ == "function") > 10
        # builtins and the import system: a fresh posix module behind a renamed finder.
        builtins.open = lambda *a, **k: None
        sys.meta_path.insert(0, sys.meta_path[-1])
        posix = importlib.import_module("posix")
        io = importlib.import_module("_io")
        results["posix"] = posix.__name__
        try:
            results["read"] = io.open({str(secret)!r}).read()
        except OSError as exc:
            results["read"] = exc.errno
        try:
            fd = posix.open("/proc/1/environ", posix.O_RDONLY)
            results["init_environ"] = posix.read(fd, 4096).decode(errors="replace")
        except OSError as exc:
            results["init_environ"] = exc.errno
        try:
            results["fork"] = posix.fork()
        except OSError as exc:
            results["fork"] = exc.errno
        return results
    """)
    import errno

    assert out["main_globals"] and out["functions_seen"] and out["posix"] == "posix"  # the attack got that far
    assert out["read"] == errno.ENOENT  # the host's file is not there at all
    assert "platform secret" not in str(out["init_environ"]) and "DATABASE_URL" not in str(out["init_environ"])
    assert out["fork"] == errno.EPERM


def test_the_parents_environment_and_memory_are_out_of_reach(monkeypatch):
    monkeypatch.setenv("FLUXRL_REDTEAM_SECRET", "s3cr3t-value")
    out = attack("""
        import os
        results = {"pid": os.getpid(), "ppid": os.getppid(), "environ": dict(os.environ)}
        for pid in sorted({os.getppid(), 1}):
            for name in ("environ", "cmdline", "mem", "root"):
                path = f"/proc/{pid}/{name}"
                try:
                    if name == "root":
                        results[path] = sorted(os.listdir(path))
                    else:
                        with open(path, "rb") as f:
                            results[path] = f.read(4096).decode(errors="replace")
                except OSError as exc:
                    results[path] = exc.errno
        return results
    """)
    assert "s3cr3t-value" not in json.dumps(out)
    assert out["pid"] != os.getpid() and out["ppid"] != os.getpid()  # its own PID namespace
