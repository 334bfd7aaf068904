"""scripts/wheelhouse.py: the offline GPU stack's parts checked, joined and installed, and never
anything that would replace the node's torch. Real pip on small real wheels, no network."""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "scripts" / "wheelhouse.py")
wheelhouse = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wheelhouse)
STACK = {"torch": "2.11", "cuda": "13", "python": "3.11", "glibc": "2.35", "counterparts": "none"}


def make_wheel(folder: Path, name: str, version: str = "1.0", payload_bytes: int = 0) -> Path:
    """A valid pure-Python wheel holding module ``name`` (VALUE = its name) and, for size, a blob
    of random bytes (incompressible, so parts split where the test expects)."""
    import os

    files = {f"{name}/__init__.py": f"VALUE = {name!r}\n".encode()}
    if payload_bytes:
        files[f"{name}/blob.bin"] = os.urandom(payload_bytes)
    dist = f"{name}-{version}.dist-info"
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name_in_zip, data in files.items():
            z.writestr(name_in_zip, data)
    return path


@pytest.fixture
def house(tmp_path):
    """A wheelhouse of three wheels (about 2.3 MiB) cut into parts of at most 1 MiB."""
    out = tmp_path / "house"
    (out / "wheels").mkdir(parents=True)
    for i, size in enumerate([900_000, 700_000, 800_000]):
        make_wheel(out / "wheels", f"fluxrl_probe_{i}", payload_bytes=size)
    manifest = wheelhouse.assemble(out, STACK, split_bytes=1 << 20)
    return out, manifest


def test_a_split_wheelhouse_is_parts_of_at_most_the_cap_each_in_a_folder_with_the_manifest(house):
    out, manifest = house
    assert not (out / "wheels").exists()
    assert [p["folder"] for p in manifest["parts"]] == ["part-01", "part-02", "part-03"]
    for part in manifest["parts"]:
        folder = out / part["folder"]
        assert (folder / part["file"]).stat().st_size == part["bytes"] <= 1 << 20
        assert json.loads((folder / "manifest.json").read_text()) == manifest
    assert sum(p["bytes"] for p in manifest["parts"]) == manifest["joined"]["bytes"]


def test_the_parts_join_into_the_wheels_the_manifest_names(house, tmp_path):
    out, manifest = house
    into = tmp_path / "join"
    into.mkdir()
    wheels = wheelhouse.gather([out / p["folder"] for p in manifest["parts"]], manifest, into)
    assert [w.name for w in wheels] == [w["file"] for w in manifest["wheels"]]
    assert [wheelhouse.sha256(w) for w in wheels] == [w["sha256"] for w in manifest["wheels"]]


def test_a_missing_part_is_named(house, tmp_path):
    out, manifest = house
    with pytest.raises(wheelhouse.WheelhouseError, match=r"1 of 3 parts missing: wheels.tar.02"):
        wheelhouse.gather([out / "part-01", out / "part-03"], manifest, tmp_path)


def test_a_damaged_part_is_refused_before_anything_is_joined(house, tmp_path):
    out, manifest = house
    part = out / "part-02" / "wheels.tar.02"
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(wheelhouse.WheelhouseError, match=r"part-02/wheels.tar.02: its SHA-256 is not the manifest's"):
        wheelhouse.gather([out], manifest, tmp_path)


def test_parts_of_two_builds_are_refused(house, tmp_path):
    out, manifest = house
    other = json.loads((out / "part-02" / "manifest.json").read_text())
    other["parts"][1]["sha256"] = "0" * 64
    (out / "part-02" / "manifest.json").write_text(json.dumps(other))
    with pytest.raises(wheelhouse.WheelhouseError, match="parts of two builds"):
        wheelhouse.load_manifests([out / "part-01", out / "part-02"])


def test_a_wheelhouse_never_carries_torch_or_its_cuda_libraries(tmp_path):
    pins = tmp_path / "stack.txt"
    for line in ["torch==2.11.0", "nvidia-nccl-cu13==2.28.9", "torchvision==0.26.0", "triton==3.6.0"]:
        pins.write_text(f"vllm==0.26.0\n{line}\n")
        with pytest.raises(wheelhouse.WheelhouseError, match="belongs to the node"):
            wheelhouse.read_pins(pins)
    pins.write_text("vllm>=0.26\n")
    with pytest.raises(wheelhouse.WheelhouseError, match="not an exact pin"):
        wheelhouse.read_pins(pins)
    (tmp_path / "wheels").mkdir()
    make_wheel(tmp_path / "wheels", "torch", "2.13.0")
    with pytest.raises(wheelhouse.WheelhouseError, match="would replace the node's torch"):
        wheelhouse.assemble(tmp_path, STACK)


def test_the_committed_stack_pins_exact_versions_and_vllm_0_26_for_torch_2_11():
    pins = dict(wheelhouse.read_pins(wheelhouse.stack_file("2.11", "13")))
    assert pins["vllm"] == "0.26.0" and pins["deepspeed"] == "0.19.8"
    with pytest.raises(wheelhouse.WheelhouseError, match="no GPU stack for torch 2.99"):
        wheelhouse.stack_file("2.99", "13")


def test_install_joins_the_parts_and_installs_offline_leaving_torch_as_it_was(house, tmp_path):
    out, manifest = house
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "wheelhouse.py"), "install", "--python", sys.executable,
         "--target", str(site), *(str(out / p["folder"]) for p in manifest["parts"])],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 wheels match the manifest" in result.stdout
    import torch

    assert f"torch is still {torch.__version__}" in result.stdout
    probe = subprocess.run([sys.executable, "-c", "import fluxrl_probe_2; print(fluxrl_probe_2.VALUE)"],
                           capture_output=True, text=True, env={"PYTHONPATH": str(site)}, timeout=60)
    assert probe.stdout.strip() == "fluxrl_probe_2"


def test_install_with_a_part_missing_installs_nothing(house, tmp_path):
    out, manifest = house
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "wheelhouse.py"), "install", "--target", str(site),
         str(out / "part-01")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "2 of 3 parts missing: wheels.tar.02, wheels.tar.03" in result.stderr
    assert not site.exists()
