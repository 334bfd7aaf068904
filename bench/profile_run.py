"""Where an engine run's CPU time goes: py-spy samples every process of a real run
(coordinator, trainer, vLLM engine core) and this sums them by role and by function.

    .venv/bin/python bench/profile_run.py [--mode async|sync] [--seconds 60] [--set resources.trainer_process=true]

Runs ``examples/add-async.yaml`` (the tiny model, 2-digit addition, 16 prompts × 8
samples a step); once its first step is logged, ``py-spy record --subprocesses --threads``
attaches for ``--seconds`` (start-up is not profiled), then this prints, per role, its share of the busy samples (a thread that
waits is not sampled) and its heaviest functions by own time. The raw collapsed stacks
go to ``bench/results/profile-<mode>.txt`` (open them with speedscope or flamegraph.pl)
and the summary to ``bench/results/profile-<mode>.json``.

Roles are read off each stack: a frame in vLLM's engine core or its model runner is the
engine core; the trainer's frames (workers/train/trainer.py, trainer_ranks.py, torch autograd)
are the trainer, in its own process or in a thread of the coordinator; reward scoring,
vLLM's client-side output processing and the controller's own code are the
coordinator's parts.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import yaml

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
from sync_vs_async import merged  # noqa: E402

EXAMPLE = ROOT / "examples" / "add-async.yaml"

# (role, pattern over the whole stack): the first that matches names the sample's role
ROLES = [
    ("engine core", re.compile(r"vllm/v1/engine/core\.py|vllm/v1/worker/|vllm/v1/executor/|model_executor/")),
    ("trainer", re.compile(r"workers/trainer\.py|workers/trainer_ranks\.py|deepspeed/|torch/autograd/|"
                           r"torch/optim/")),
    ("reward scoring", re.compile(r"workers/reward_service\.py|workers/rewards\.py")),
    ("vLLM client (output processing)", re.compile(r"vllm/v1/engine/(async_llm|output_processor|detokenizer|"
                                                   r"logprobs)\.py|vllm/v1/engine/core_client\.py")),
    ("weights (export / sync)", re.compile(r"workers/weight_sync\.py|workers/weight_broadcast\.py|safetensors")),
    ("coordinator (controller)", re.compile(r"workers/controller\.py|workers/staleness\.py|workers/rollout\.py|"
                                            r"workers/engine_server\.py")),
    ("event loop / threads", re.compile(r"asyncio/|threading\.py|concurrent/futures")),
]


def role_of(frames: list[str]) -> str:
    stack = ";".join(frames)
    for role, pattern in ROLES:
        if pattern.search(stack):
            return role
    return "other"


def parse(raw: Path) -> tuple[Counter, dict[str, Counter], int]:
    """Busy samples per role, and per role the own-time samples of each function."""
    by_role: Counter = Counter()
    functions: dict[str, Counter] = defaultdict(Counter)
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        role = role_of(frames)
        by_role[role] += n
        functions[role][frames[-1]] += n
        total += n
    return by_role, functions, total


def _steps(metrics: Path) -> int:
    return sum(1 for line in metrics.read_text().splitlines() if '"reward/mean"' in line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["async", "sync"], default="async")
    p.add_argument("--seconds", type=float, default=60.0, help="training loop budget (stop.max_minutes)")
    p.add_argument("--rate", type=int, default=50, help="samples per second per thread")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a spec override, e.g. resources.trainer_process=true (YAML value)")
    p.add_argument("--tag", default=None, help="name of the result files (default: profile-<mode>)")
    p.add_argument("--top", type=int, default=8, help="functions shown per role")
    args = p.parse_args()
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    over: dict = {"name": f"profile-{args.mode}", "schedule": {"mode": args.mode},
                  # the run outlasts the profile: py-spy attaches once the first step is logged
                  "stop": {"max_minutes": (args.seconds + 20) / 60, "max_steps": 10 ** 9},
                  "eval": {"every_steps": 0, "prompts": 50}}
    for item in args.set:
        key, _, value = item.partition("=")
        node = over
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    spec = merged(yaml.safe_load(EXAMPLE.read_text()), over)
    tag = args.tag or f"profile-{args.mode}"
    results = BENCH / "results"
    results.mkdir(exist_ok=True)
    raw = results / f"{tag}.txt"
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out = Path(tmp) / "spec.yaml", Path(tmp) / "out"
        spec_path.write_text(yaml.safe_dump(spec))
        run = subprocess.Popen([sys.executable, "-m", "workers", "run", str(spec_path), "--out", str(out),
                                "--no-progress"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
        metrics = out / "metrics.jsonl"
        # start-up (model load, vLLM and DeepSpeed start, the first evaluation) is not profiled
        while run.poll() is None and not (metrics.exists() and '"reward/mean"' in metrics.read_text()):
            time.sleep(0.5)
        if run.poll() is not None:
            raise SystemExit(f"the run ended before its first step:\n{run.stderr.read()[-3000:]}")
        steps_before = _steps(metrics)
        t0 = time.time()
        spy = subprocess.run([py_spy, "record", "--pid", str(run.pid), "--subprocesses", "--threads",
                              "--nonblocking", "--rate", str(args.rate), "--duration", str(int(args.seconds)),
                              "--format", "raw", "-o", str(raw)], capture_output=True, text=True)
        window = time.time() - t0
        steps = _steps(metrics) - steps_before
        _, err = run.communicate()
        if spy.returncode != 0:
            raise SystemExit(f"py-spy failed (it needs ptrace: run as root or allow it):\n{spy.stderr[-2000:]}")
        if run.returncode != 0:
            raise SystemExit(f"the profiled run failed:\n{err[-3000:]}")
    samples = steps * spec["schedule"]["batch_prompts"] * spec["algorithm"]["group_size"]
    by_role, functions, total = parse(raw)
    print(f"{args.mode}: {steps} steps ({samples} samples) in the {window:.1f} s profiled "
          f"({samples / window:.1f} samples/s); {total} busy samples at {args.rate}/s per thread "
          f"= {total / args.rate / window:.2f} busy threads on average")
    summary = {"mode": args.mode, "overrides": args.set, "window_s": window, "steps": steps,
               "samples_per_s": samples / window, "rate": args.rate, "busy_samples": total, "roles": {}}
    for role, n in by_role.most_common():
        print(f"\n{role}: {n / total:.1%} of busy samples")
        top = functions[role].most_common(args.top)
        for frame, k in top:
            print(f"  {k / total:6.1%}  {frame}")
        summary["roles"][role] = {"share": n / total, "top": [[frame, k / total] for frame, k in top]}
    (results / f"{tag}.json").write_text(json.dumps(summary, indent=2))
    print(f"\nraw stacks: {raw}")


if __name__ == "__main__":
    main()
