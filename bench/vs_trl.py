"""FluxRL against TRL's GRPO over a matrix of workloads, at equal cores, in one invocation,
with each FluxRL step's time breakdown printed beside TRL's time.

    .venv/bin/python bench/vs_trl.py [--workloads tiny,zoo-qwen2,...] [--rounds 3] [--minutes 3]

Workloads (``--workloads``, default all):

- ``tiny``: the tiny model on 2-digit addition (``examples/add-async.yaml``): per-call overhead;
- ``zoo-qwen2``: the zoo Qwen2 on chat sums (bench/vs_plain.py's ``--model qwen2``);
- ``real-size-8``: Qwen2.5-0.5B's shape (random weights) at 8 new tokens: training-bound;
- ``real-size-256``: the same at 256 new tokens (random weights rarely stop early): generation-bound;
- ``long-tail``: the tiny model on running sums (``gen:chain``, sync_vs_async.py's task), whose
  answers run from 1–2 to 30+ tokens: skewed output lengths at the scale this machine runs.

Systems (``--systems``, default all; each workload runs them interleaved over ``--rounds``):

- ``trl``: TRL 1.16's ``GRPOTrainer`` with HF generation (bench/trl_grpo.py; bench-only:
  ``.venv/bin/pip install trl==1.16.0``), as many torch threads as the machine has cores;
- ``trl_vllm``: the same with TRL's vLLM colocate mode; where it cannot run on this machine
  the error is recorded as the reason, and it is not tried again that invocation;
- ``sync``, ``async``: FluxRL with ``schedule.mode`` sync and async (the example's settings);
- the workload's candidates for FluxRL's best configuration (``BEST_CANDIDATES``, from
  bench/vs_plain.py's ``ENGINE_SYSTEMS``). The table's "FluxRL best" is the fastest FluxRL
  system measured on that workload, named.

Every system gets the workload's model, data, batch, lr, precision and ``--minutes`` of
training loop; samples/s leaves the periodic evaluations out (bench/vs_plain.py's clocks).
Each FluxRL run reports ``time/<part>_s`` per step (workers/coord/time_breakdown.py); the
table prints their mean shares beside TRL's split of its step (generation and scoring
against training). The results file (``bench/results/vs_trl-<date>[-<workloads>].json``)
carries a ``meta`` block: date, commit, machine (CPU model, cores) and the exact command.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import yaml  # noqa: E402
from tqdm import tqdm  # noqa: E402
from tqdm.contrib import DummyTqdmFile  # noqa: E402

from sync_vs_async import ROOT, interleaved, merged  # noqa: E402
from vs_plain import ENGINE_SYSTEMS, EXAMPLE, engine_run, real_size_spec, summarize, zoo_spec  # noqa: E402
from workers.coord.time_breakdown import PARTS, summarize as breakdown  # noqa: E402
from workers.io.checkpoint import read_metrics  # noqa: E402


@dataclass(frozen=True)
class Workload:
    what: str  # the regime it stands for
    build: Callable[[dict, Path, int], dict]  # (the example's spec, a scratch folder, eval prompts) -> its spec
    best: tuple[str, ...]  # FluxRL configurations to try besides sync and async


def _tiny(spec: dict, folder: Path, eval_prompts: int) -> dict:
    return spec


def _long_tail(spec: dict, folder: Path, eval_prompts: int) -> dict:
    return merged(spec, {"task": {"dataset": "gen:chain?max_value=10&max_terms=12", "size": 4000, "eval_size": 200},
                         "algorithm": {"lr": 1.0e-4}, "rollout": {"max_tokens": 48},
                         "eval": {"prompts": min(eval_prompts, 200)}})


def _real_size(max_tokens: int):
    def build(spec: dict, folder: Path, eval_prompts: int) -> dict:
        real = real_size_spec(spec, folder)
        if max_tokens == real["rollout"]["max_tokens"]:
            return real
        # room for the prompt and the longer answer
        return merged(real, {"rollout": {"max_tokens": max_tokens, "max_model_len": max_tokens + 256}})
    return build


WORKLOADS = {
    "tiny": Workload("overhead-bound: 0.66M parameters, 8 new tokens", _tiny, ("sync_single", "async_server_single")),
    "zoo-qwen2": Workload("small chat model, 16 new tokens",
                          lambda spec, folder, n: zoo_spec(spec, "qwen2", folder, n), ("async_one_step", "async_shared")),
    "real-size-8": Workload("training-bound: Qwen2.5-0.5B's shape, 8 new tokens", _real_size(8), ("async_shared",)),
    "real-size-256": Workload("generation-bound: Qwen2.5-0.5B's shape, 256 new tokens", _real_size(256), ()),
    "long-tail": Workload("skewed lengths: running sums, 1 to 30+ tokens of 48", _long_tail,
                          ("async_one_step", "sync_stream", "async_longest_first")),
}
PEERS = ("trl", "trl_vllm")
SYSTEMS = ("trl", "trl_vllm", "sync", "async")


# -- where a results file comes from ----------------------------------------------------------
def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _commit() -> str:
    """The checked-out commit, with ``+dirty`` where the work tree differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def meta(argv: list[str]) -> dict:
    """The ``meta`` block every results file written from now on carries (tests/bench/test_results_files.py)."""
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    return {"date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(), "commit": _commit(),
            "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": mem},
            "command": shlex.join([".venv/bin/python", os.path.relpath(argv[0], ROOT), *argv[1:]]),
            "load_average": round(os.getloadavg()[0], 2)}


def settle(limit_s: float = 240.0) -> None:
    """Wait (at most ``limit_s``) for the 1-minute load average to fall below the core count:
    right after another bench it still counts that bench's processes, and the results file
    records it (a row measured above the core count shows no ratio)."""
    import time

    cores, t0 = os.cpu_count() or 1, time.time()
    while os.getloadavg()[0] >= cores and time.time() - t0 < limit_s:
        print(f"waiting for the load average ({os.getloadavg()[0]:.2f}) to fall below {cores}...", flush=True)
        time.sleep(15)


# -- one run --------------------------------------------------------------------------------------
def _peer(system: str, spec: dict, threads: int) -> dict:
    """TRL in a process of its own (bench/vs_plain.py says why), HF or vLLM generation."""
    import multiprocessing

    from trl_grpo import trl_run

    with multiprocessing.get_context("spawn").Pool(1) as pool:  # leaving it terminates a run that hangs
        r = pool.apply_async(trl_run, (spec, threads, system == "trl_vllm")).get(
            timeout=60 * spec["stop"]["max_minutes"] + 900)
    steps = max(1, r["steps"])
    train_s = r["seconds"] - r["eval_s"]
    r["breakdown"] = {"step_s": train_s / steps, "generation_s": r["generation_s"] / steps,
                      "generation_share": r["generation_s"] / train_s if train_s > 0 else 0.0}
    return r


def _fluxrl(system: str, spec: dict, workdir: Path) -> dict:
    r = engine_run(system, spec, workdir)
    by_step: dict[int, dict] = {}
    for p in read_metrics(workdir / system / "metrics.jsonl"):
        if p["key"].startswith("time/"):
            by_step.setdefault(p["step"], {})[p["key"]] = p["value"]
    r["breakdown"] = breakdown([by_step[s] for s in sorted(by_step)])
    return r


def _summary(runs: list[dict]) -> dict:
    out = summarize(runs)
    parts = [r["breakdown"] for r in runs if r.get("breakdown")]
    out["breakdown"] = {k: statistics.median(b[k] for b in parts) for k in parts[0]} if parts else {}
    return out


# -- the table ------------------------------------------------------------------------------------
def _shares(s: dict) -> str:
    b = s.get("breakdown") or {}
    if "forward_share" not in b:  # TRL: generation and scoring against the rest
        return f"gen+score {b.get('generation_share', 0):.0%}, train {1 - b.get('generation_share', 0):.0%}" if b else "-"
    named = {"gen": "generation", "score": "scoring", "gate": "gate_wait", "fwd": "forward", "bwd": "backward",
             "opt": "optimizer", "upd": "weight_update", "eval": "eval", "idle": "idle"}
    assert set(named.values()) == set(PARTS)
    return " ".join(f"{short} {b[part + '_share']:.0%}" for short, part in named.items() if b[part + "_share"] >= 0.005)


def print_workload(name: str, summary: dict, skipped: dict[str, str]) -> Optional[dict]:
    """The workload's table; returns its row of the matrix (None without TRL's figure)."""
    print(f"\n== {name}: {WORKLOADS[name].what}")
    peer = summary.get("trl")
    print(f"{'system':<20} {'samples/s':>9} {'(min–max)':>13} {'× TRL':>6} {'acc before→after':>17} {'steps':>5} "
          f"{'s/step':>7}  where a step's time goes")
    for system, s in summary.items():
        times = f"{s['samples_per_s_min']:.1f}–{s['samples_per_s_max']:.1f}"
        ratio = f"{s['samples_per_s'] / peer['samples_per_s']:.2f}" if peer and peer["samples_per_s"] else "-"
        step = (s.get("breakdown") or {}).get("step_s")
        print(f"{system:<20} {s['samples_per_s']:>9.2f} {times:>13} {ratio:>6} {s['accuracy_before']:>8.3f}→"
              f"{s['accuracy_after']:.3f} {s['steps']:>5} {step if step is not None else float('nan'):>7.2f}  {_shares(s)}")
    for system, why in skipped.items():
        print(f"{system:<20} not run: {why}")
    flux = {k: v for k, v in summary.items() if k not in PEERS}
    if not peer or not flux:
        return None
    best = max(flux, key=lambda k: flux[k]["samples_per_s"])
    row = {"trl": peer["samples_per_s"], "best": best, "best_samples_per_s": flux[best]["samples_per_s"],
           "best_x_trl": flux[best]["samples_per_s"] / peer["samples_per_s"]}
    for mode in ("sync", "async"):
        if mode in flux:
            row[f"{mode}_x_trl"] = flux[mode]["samples_per_s"] / peer["samples_per_s"]
    if "trl_vllm" in summary:
        row["trl_vllm_x_trl"] = summary["trl_vllm"]["samples_per_s"] / peer["samples_per_s"]
    print(f"FluxRL best: {best}, {row['best_x_trl']:.2f}× TRL")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--systems", default=None,
                   help="comma-separated (default: trl, trl_vllm, sync, async and each workload's best candidates)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per workload; medians are reported")
    p.add_argument("--minutes", type=float, default=3.0, help="training loop budget per system and round")
    p.add_argument("--eval-every", type=int, default=20, help="steps between held-out evaluations")
    p.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts evaluated")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="TRL's torch threads (default: this machine's cores, as FluxRL uses)")
    p.add_argument("--json", default=None, help="default: bench/results/vs_trl-<date>[-<workloads>].json")
    args = p.parse_args()
    workloads = args.workloads.split(",")
    if not set(workloads) <= set(WORKLOADS):
        p.error(f"--workloads: any of {', '.join(WORKLOADS)}")
    chosen = args.systems.split(",") if args.systems else None
    if chosen and not set(chosen) <= set(PEERS) | set(ENGINE_SYSTEMS):
        p.error(f"--systems: any of {', '.join([*PEERS, *ENGINE_SYSTEMS])}")
    settle()
    info = meta(sys.argv)
    suffix = "" if workloads == list(WORKLOADS) else "-" + "+".join(workloads)
    json_path = Path(args.json or BENCH / "results" / f"vs_trl-{info['date']}{suffix}.json")
    skipped: dict[str, str] = {}  # a peer that cannot run here: why
    out: dict = {"meta": info, "args": vars(args), "workloads": {}, "matrix": {}}

    for name in workloads:
        wl = WORKLOADS[name]
        systems = chosen or [*SYSTEMS, *wl.best]
        with tempfile.TemporaryDirectory() as tmp:
            spec = merged(yaml.safe_load(EXAMPLE.read_text()), {
                "stop": {"max_minutes": args.minutes},
                "eval": {"every_steps": args.eval_every, "prompts": args.eval_prompts}})
            spec = wl.build(spec, Path(tmp), args.eval_prompts)
            bar = tqdm(total=args.rounds * len(systems), desc=name, unit="run", file=sys.stdout, dynamic_ncols=True)

            def one(system: str, tag: str) -> Optional[dict]:
                bar.update(1)
                if system in skipped:
                    return None
                try:
                    r = _peer(system, spec, args.threads) if system in PEERS else _fluxrl(system, spec, Path(tmp) / tag)
                except Exception as exc:  # noqa: BLE001 - a peer or candidate that cannot run here is recorded
                    if system in ("trl", "sync", "async"):
                        raise
                    skipped[system] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
                    return None
                r.update(train_s=r["seconds"] - r["eval_s"], outside_s=r["wall_s"] - r["seconds"])
                # no target accuracy here: each system's accuracy is reported as it is
                r.update(samples_per_s=r["trained_samples"] / r["train_s"], target=None, time_to_target_s=None)
                return r

            with contextlib.redirect_stdout(DummyTqdmFile(sys.stdout)):
                runs = interleaved(systems, args.rounds, one)
            bar.close()
        runs = {k: [r for r in v if r is not None] for k, v in runs.items()}
        summary = {k: _summary(v) for k, v in runs.items() if v}
        row = print_workload(name, summary, {k: v for k, v in skipped.items() if k in systems})
        out["workloads"][name] = {"what": wl.what, "spec": spec, "summary": summary, "runs": runs,
                                  "not_run": {k: v for k, v in skipped.items() if k in systems}}
        if row is not None:
            out["matrix"][name] = row
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=2))  # after each workload: a long matrix keeps what it has
    out["meta"]["load_average_end"] = round(os.getloadavg()[0], 2)
    json_path.write_text(json.dumps(out, indent=2))
    print(f"\nresults: {os.path.relpath(json_path, ROOT)} ({info['date']}, {info['commit']}, "
          f"{info['machine']['cpu']}, {info['machine']['cores']} cores)")
    cores = info["machine"]["cores"] or 1
    if max(info["load_average"], out["meta"]["load_average_end"]) > cores:
        # torch's OpenMP threads spin-wait: oversubscribed, a one-process peer at as many
        # threads as cores slows down many times over while FluxRL's pinned processes do not
        print(f"warning: the load average passed {cores} (this machine's cores) during the run: TRL's "
              f"{args.threads} torch threads may have collapsed under the oversubscription; the ratios are not "
              "a comparison of the systems; rerun on an idle machine")


if __name__ == "__main__":
    main()
