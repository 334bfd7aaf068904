"""docker-compose.yml and the Dockerfile, read as files (no Docker engine is needed): the
internet-facing containers hold no privileges, every secret is required, nothing listens
beyond loopback, and the image does not run as root."""
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PRIVILEGED_SERVICE = "sandbox"  # bubblewrap's namespaces need CAP_SYS_ADMIN; nothing else may have it
SECRET_NAMES = ("PASSWORD", "SECRET", "REDISCLI_AUTH")
REQUIRED = re.compile(r"\$\{(\w+):\?[^}]+\}")  # ${VAR:?message}: compose refuses to start without VAR


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


def environment(service: dict) -> dict:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return env


def test_no_service_but_the_sandbox_has_capabilities_apparmor_unconfined_or_privileged(services):
    assert PRIVILEGED_SERVICE in services
    for name, service in services.items():
        if name == PRIVILEGED_SERVICE:
            continue
        opts = service.get("security_opt") or []
        assert not service.get("privileged"), name
        assert not any("unconfined" in opt for opt in opts), (name, opts)
        assert "SYS_ADMIN" not in (service.get("cap_add") or []), name
        assert not (set(service.get("cap_add") or []) & {"SYS_ADMIN", "NET_ADMIN", "SYS_PTRACE", "ALL"}), name
    assert services[PRIVILEGED_SERVICE].get("cap_add") == ["SYS_ADMIN"]  # and nothing more


def test_the_app_containers_drop_every_capability(services):
    for name in ("web", "celery-cpu", "celery-gpu", "beat"):
        assert services[name].get("cap_drop") == ["ALL"], name
        assert not services[name].get("cap_add"), name
        assert services[name].get("user") in (None, "fluxrl", "10001"), name  # the image's non-root user


def test_every_service_sets_no_new_privileges(services):
    for name, service in services.items():
        assert "no-new-privileges:true" in (service.get("security_opt") or []), name


def test_published_ports_bind_loopback_only(services):
    published = [(name, str(port)) for name, service in services.items() for port in service.get("ports") or []]
    assert published, "web publishes 8000"
    for name, port in published:
        assert port.startswith("127.0.0.1:"), (name, port)


def test_every_secret_is_required_without_a_default(services):
    seen = set()
    for name, service in services.items():
        for key, value in environment(service).items():
            text = str(value or "")
            if any(s in key for s in SECRET_NAMES) or re.search(r"://[^/@]*:[^/@]*@", text):
                # the value (or the URL's password) is ${VAR:?...}: no default, no literal
                assert REQUIRED.search(text), (name, key, text)
                assert not re.search(r"\$\{\w+:?-", text), (name, key, text)
                seen.update(REQUIRED.findall(text))
    assert {"POSTGRES_PASSWORD", "REDIS_PASSWORD", "DJANGO_SECRET_KEY", "FLUXRL_CLUSTER_KEY_SECRET"} <= seen


def test_redis_requires_a_password_and_every_redis_url_carries_it(services):
    command = services["redis"]["command"]
    command = command if isinstance(command, str) else " ".join(command)
    assert re.search(r"--requirepass \$\{REDIS_PASSWORD:\?", command), command
    urls = [environment(s)["REDIS_URL"] for s in services.values() if "REDIS_URL" in environment(s)]
    assert len(urls) >= 4
    for url in urls:
        assert url.startswith("redis://:${REDIS_PASSWORD:?"), url


def test_the_django_secret_is_held_by_the_web_container_alone_and_not_on_the_data_volume(services):
    holders = {name for name, s in services.items() if "DJANGO_SECRET_KEY" in environment(s)}
    assert holders == {"web"}
    # the engines' workers get the cluster-key secret instead, and the sandbox nothing
    assert {n for n, s in services.items() if "FLUXRL_CLUSTER_KEY_SECRET" in environment(s)} == {"celery-cpu", "celery-gpu"}
    sandbox = services[PRIVILEGED_SERVICE]
    assert not ({"DATABASE_URL", "DJANGO_SECRET_KEY", "FLUXRL_CLUSTER_KEY_SECRET"} & set(environment(sandbox)))
    assert not sandbox.get("volumes"), "the sandbox mounts no data volume"


def test_the_web_process_sends_try_it_to_the_sandbox_queue(services):
    assert environment(services["web"])["FLUXRL_TRY_QUEUE"] == "sandbox"
    assert "-Q sandbox" in services[PRIVILEGED_SERVICE]["command"]
    assert "fluxrl.rewards.sandbox_app" in services[PRIVILEGED_SERVICE]["command"]


def test_no_demo_admin_is_created_by_compose():
    text = (REPO / "docker-compose.yml").read_text()
    assert "bootstrap_demo" not in text
    assert not re.search(r"\bdemo\b", text)


def test_the_dockerfile_runs_as_a_non_root_user():
    users = re.findall(r"^USER\s+(\S+)", (REPO / "Dockerfile").read_text(), flags=re.M)
    assert users, "the Dockerfile has no USER: the containers run as root"
    assert users[-1] not in ("root", "0", "0:0")


def test_the_env_file_with_the_secrets_is_kept_out_of_the_image():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".env" in ignored


def test_the_user_rewards_override_privileges_only_the_workers_with_disjoint_uid_ranges(services):
    override = yaml.safe_load((REPO / "docker-compose.user-rewards.yml").read_text())["services"]
    assert set(override) == {"celery-cpu", "celery-gpu"}  # never web or beat
    bases = {services[PRIVILEGED_SERVICE].get("environment", {}).get("FLUXRL_SANDBOX_UID_BASE", "61000")}
    for name, service in override.items():
        assert service["cap_add"] == ["SYS_ADMIN"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        bases.add(service["environment"]["FLUXRL_SANDBOX_UID_BASE"])
    # each pool is 64 uids by default (FLUXRL_SANDBOX_UID_COUNT); the ranges must not meet
    starts = sorted(int(b) for b in bases)
    assert len(starts) == 3 and all(b - a >= 64 for a, b in zip(starts, starts[1:]))


def _gigabytes(size: str) -> float:
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)b?", str(size).lower()).groups()
    return float(number) * {"": 1 / 2**30, "k": 1 / 2**20, "m": 1 / 2**10, "g": 1}[unit]


def test_the_gpu_worker_has_shared_memory_for_nccl_without_the_hosts_ipc_namespace(services):
    # Docker's 64 MB /dev/shm fails NCCL's first large collective between the container's processes
    assert _gigabytes(services["celery-gpu"].get("shm_size", "64m")) >= 8
    for name, service in services.items():
        assert service.get("ipc") != "host", name
