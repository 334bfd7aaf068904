"""FluxRL against a plain colocated GRPO loop: the same model, task, held-out set and time
budget, interleaved over rounds in one invocation (this machine is shared and noisy:
compare ratios, not absolutes).

    .venv/bin/python bench/vs_plain.py [--rounds 3] [--minutes 4] [--quick]
    .venv/bin/python bench/vs_plain.py --model qwen2 [--rounds 2]   # a chat model of another architecture

Takes about rounds × (3 × minutes + 2.5) minutes: an engine run spends about a minute
outside its training loop (vLLM and DeepSpeed start-up, evaluations before and after).

Systems, all on ``examples/add-async.yaml`` (the tiny model, 2-digit addition, 16 prompts
× 8 samples a step, lr 3e-4, numeric_match):

- plain: one process, HF sampling, Adam, group advantages, token-mean loss
  (``grpo_step`` of bench/rl_regime.py);
- trl: TRL's GRPOTrainer with the same settings (bench/trl_grpo.py; a bench-only
  dependency, ``.venv/bin/pip install trl==1.16.0``), the peer a team would try first;
- sync: the engine (``python -m workers run``) with ``schedule.mode: sync``;
- async: the engine as the example has it (keep updates, max staleness 2).

Other engine systems (``--systems plain,...``): ``async_proc``/``sync_proc`` (the trainer in
a process of its own), ``sync_single`` (vLLM's model in its engine core), ``async_server``
(the engine in a server process of its own, as on GPUs, vLLM's engine core beside it) and
``async_server_single`` (the same server with vLLM inside it: no engine core process, no
worker process, nothing spin-waiting, and no interpreter lock shared with the trainer),
``async_one_step`` (async with TRL's optimiser work per batch: one step, ``algorithm.minibatches
1``, where the example's decoupled PPO takes two minibatch steps and a proximal forward) and
``async_one_step_eta4`` (the same with ``schedule.max_staleness: 4``).

``--model real-size`` runs TRL (``trl``) and the engine (``sync``, ``async``) on Qwen2.5-0.5B's
exact shape (workers/models/realsize.py: 494 M parameters, vocabulary 151,936, random weights,
built once under ``$FLUXRL_MODEL_CACHE``) at ``examples/own-model/real-size.yaml``'s settings:
bfloat16 (FluxRL's trainer at ZeRO 0 autocasts over fp32 weights, and so does TRL's, with
``bf16=True``), 4 prompts × 4 samples, 8 new tokens, one optimiser step per batch. Random
weights learn nothing: samples/s is the measure; the reward curve is in the JSON.

``--model qwen2|llama|gpt2`` runs TRL and the engine on a chat model of that architecture
(workers/models/modelzoo.py's shipped warm start: its own tokenizer and chat template) on a
chat JSONL dataset of sums with a 2-digit operand, with the zoo runs' settings (lr 1e-4,
advantages divided by the group's std, 16 new tokens, 200 held-out prompts). The plain loop
knows only the tiny model's character tokenizer, so there TRL comes first and sets the
target: the engine's time to TRL's final accuracy.

Each gets ``--minutes`` of training loop (as ``stop.max_minutes`` counts it: periodic
evaluations included). Clocks below leave the periodic evaluations out, so that the
plain loop's HF evaluation and the engine's vLLM one cost nothing either way. Reported
per system: trained samples/s, held-out greedy accuracy before → after, and the training
time to reach a target accuracy (default: the first system's accuracy after its budget, in
the same round: the plain loop's, or TRL's on a zoo model), with ratios to the first system.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import torch  # noqa: E402
import yaml  # noqa: E402
from tqdm import tqdm  # noqa: E402
from tqdm.contrib import DummyTqdmFile  # noqa: E402

from rl_regime import grpo_optimizer, grpo_step  # noqa: E402
from sync_vs_async import ROOT, interleaved, median_run, merged, run as run_engine  # noqa: E402
from workers.models import tinymodel  # noqa: E402
from workers.tasks import builtin_rewards as rewards, datasets as tasks  # noqa: E402
from workers.io.checkpoint import read_metrics  # noqa: E402
from workers.models.tinymodel import greedy_accuracy  # noqa: E402

EXAMPLE = ROOT / "examples" / "add-async.yaml"
# Overrides of the example spec per engine system (plain reads the same spec).
ENGINE_SYSTEMS = {"sync": {"schedule": {"mode": "sync"}}, "async": {},
                  # the trainer in a process of its own (no interpreter lock shared with the coordinator)
                  "async_proc": {"resources": {"trainer_process": True}},
                  "sync_proc": {"schedule": {"mode": "sync"}, "resources": {"trainer_process": True}},
                  # vLLM's model in its engine core process (no worker process spin-waiting)
                  "sync_single": {"schedule": {"mode": "sync"}, "rollout": {"cpu_single_process": True}},
                  # the engine in a server process of its own (the GPU launch path), vLLM's engine core
                  # in a process of its own beside it, or inside it (no core process, nothing to spin)
                  "async_server": {"resources": {"engine_processes": True}},
                  "async_server_single": {"resources": {"engine_processes": True},
                                          "rollout": {"cpu_single_process": True}}}
# TRL's optimiser work per batch: one step (the example's decoupled PPO takes two minibatch steps
# and a proximal forward per batch)
ENGINE_SYSTEMS["async_one_step"] = {"algorithm": {"minibatches": 1}}
# the same with twice the staleness bound: at 2 the staleness sat at its cap (generation waiting
# for the trainer) while the trainer still waited for batches a quarter of the time
ENGINE_SYSTEMS["async_one_step_eta4"] = {"algorithm": {"minibatches": 1}, "schedule": {"max_staleness": 4}}
# generation and training on the same cores, time-sliced by the OS, instead of half each
# (resources.cpu_overlap): a role that waits leaves its cores to the other
ENGINE_SYSTEMS["async_shared"] = {"resources": {"cpu_overlap": "shared"}}
# sync with the tail of each step's generation filled by training on the groups already
# scored (StreamRL's stream generation), and async taking the predicted-longest groups first
ENGINE_SYSTEMS["sync_stream"] = {"schedule": {"mode": "sync", "stream_train": True}}
ENGINE_SYSTEMS["async_longest_first"] = {"schedule": {"dispatch": "longest_first"}}
SYSTEMS = ["plain", "trl", "sync", "async"]
ZOO_SYSTEMS = ["trl", "async"]  # the plain loop tokenizes with the tiny model's characters only
REAL_SIZE, REAL_SIZE_SYSTEMS = "real-size", ["trl", "sync", "async"]
OTHER_LOOPS = ("trl",)  # systems that are neither the plain loop nor the engine
NO_STEP_LIMIT = 10 ** 9  # the time budget stops every run


def plain_run(spec: dict, threads: int) -> dict:
    """The plain loop under the spec's settings and time budget, measured like an engine run."""
    t_wall = time.time()
    torch.set_num_threads(threads)
    torch.manual_seed(spec.get("seed", 0))
    rng = random.Random(spec.get("seed", 0))
    from transformers import AutoModelForCausalLM

    # grpo_step tokenizes with the tiny model's character table: builtin:tiny only
    assert spec["model"]["path"] == "builtin:tiny", spec["model"]["path"]
    model = AutoModelForCausalLM.from_pretrained(tinymodel.ensure_tiny_model(), dtype=torch.float32)
    task, algo, rollout = spec["task"], spec["algorithm"], spec["rollout"]
    train, held = tasks.load_rows(task["dataset"], task["size"], task["eval_size"], task.get("seed", 0))
    held = held[:spec["eval"]["prompts"]]
    reward = rewards.BUILTIN_REWARDS[spec["reward"]["function"]]
    max_new, temperature, group = rollout["max_tokens"], rollout["temperature"], algo["group_size"]
    evaluate = lambda: greedy_accuracy(model, held, max_new)  # noqa: E731

    before = evaluate()
    curve = [(0.0, before)]
    opt, sched = grpo_optimizer(model, algo["lr"], algo.get("warmup_steps", 10))
    budget_s, every = 60 * spec["stop"]["max_minutes"], spec["eval"]["every_steps"]
    steps, eval_s, t_start = 0, 0.0, time.time()
    while time.time() - t_start <= budget_s:  # checked before each step, as the engine does
        grpo_step(model, opt, sched, rng.sample(train, spec["schedule"]["batch_prompts"]), group, max_new,
                  temperature, reward)
        steps += 1
        if every and steps % every == 0:
            t_eval = time.time()
            curve.append((t_eval - t_start - eval_s, evaluate()))
            eval_s += time.time() - t_eval
    seconds = time.time() - t_start
    after = evaluate()
    curve.append((seconds - eval_s, after))
    return {"system": "plain", "steps": steps, "trained_samples": steps * spec["schedule"]["batch_prompts"] * group,
            "seconds": seconds, "eval_s": eval_s, "accuracy_before": before, "accuracy_after": after,
            "curve": curve, "wall_s": time.time() - t_wall, "threads": threads}


def engine_curve(points: list[dict], seconds: float) -> tuple[list[tuple[float, float]], float]:
    """Held-out accuracy against training time with the periodic evaluations taken out, and
    the time they took. The first eval/accuracy point ends just before the training clock
    starts, the last one runs after it stops; each one between runs right after its
    step's metrics are logged."""
    evals = sorted((p for p in points if p["key"] == "eval/accuracy"), key=lambda p: p["time"])
    step_done = {p["step"]: p["time"] for p in points if p["key"] == "reward/mean"}
    t_start = evals[0]["time"]
    curve, eval_s = [(0.0, evals[0]["value"])], 0.0
    for p in evals[1:-1]:
        curve.append((step_done[p["step"]] - t_start - eval_s, p["value"]))
        eval_s += p["time"] - step_done[p["step"]]
    curve.append((seconds - eval_s, evals[-1]["value"]))
    return curve, eval_s


def engine_run(system: str, spec: dict, workdir: Path) -> dict:
    result = run_engine(system, NO_STEP_LIMIT, workdir, ENGINE_SYSTEMS[system], base=spec)
    curve, eval_s = engine_curve(read_metrics(workdir / system / "metrics.jsonl"), result["seconds"])
    # the engine's own samples/s counts the periodic evaluations: kept, but renamed
    result["engine_samples_per_s"] = result.pop("samples_per_s")
    return {**result, "system": system, "curve": curve, "eval_s": eval_s}


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """Training seconds to the first evaluation at or above ``target`` (None: never)."""
    return next((t for t, acc in curve if acc >= target - 1e-9), None)


def summarize(runs: list[dict]) -> dict:
    """The median-throughput run with the spread over rounds (median_run), plus the medians
    of the other measures over all rounds."""
    out = median_run(runs)
    reached = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
    times = sorted(r["time_to_target_s"] if r["time_to_target_s"] is not None else math.inf for r in runs)
    ttt = times[(len(times) - 1) // 2]  # the lower middle, as median_run takes
    out.update(time_to_target_s=None if math.isinf(ttt) else ttt, reached_target=len(reached),
               accuracy_after=statistics.median(r["accuracy_after"] for r in runs),
               all_accuracy_after=[r["accuracy_after"] for r in runs],
               all_time_to_target_s=[r["time_to_target_s"] for r in runs])
    return out


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def print_table(summary: dict[str, dict], targets: list[float], args) -> None:
    first_name = next(iter(summary))  # the target setter: plain, or TRL on a zoo model
    first = summary[first_name]
    setter = "the plain loop" if first_name == "plain" else first_name
    print()
    print(f"target: held-out greedy accuracy {', '.join(f'{t:.3f}' for t in targets)} (per round; "
          f"{'--target' if args.target is not None else setter + ' after its budget'}); "
          f"{args.minutes:g} min of training loop per system and round, {args.rounds} round(s)")
    print(f"model: {args.model}")
    if any(t <= first["accuracy_before"] for t in targets):
        print("a target is not above the starting accuracy: every system reaches it at 0 s")
    print(f"{'system':<10} {'samples/s':>9} {'(min–max)':>13} {'× ' + first_name:>7} {'acc before→after':>17} "
          f"{'to target s':>11} {'reached':>7} {'× ' + first_name:>7} {'train s':>7} {'eval s':>6} {'outside s':>9}")
    for name, s in summary.items():
        ttt = f"{s['time_to_target_s']:.1f}" if s["time_to_target_s"] is not None else "never"
        spread = f"({s['samples_per_s_min']:.0f}–{s['samples_per_s_max']:.0f})"
        speed_ratio = ratio(s["samples_per_s"], first["samples_per_s"])
        ttt_ratio = ratio(s["time_to_target_s"], first["time_to_target_s"])
        print(f"{name:<10} {s['samples_per_s']:>9.1f} {spread:>13} {speed_ratio:>7} "
              f"{s['accuracy_before']:>8.3f}→{s['accuracy_after']:.3f} {ttt:>11} "
              f"{s['reached_target']:>3}/{s['rounds']:<3} {ttt_ratio:>7} "
              f"{s['train_s']:>7.1f} {s['eval_s']:>6.1f} {s['outside_s']:>9.1f}")
    print("samples/s and time to target leave periodic evaluations out; outside s: process start, model "
          "load, vLLM/DeepSpeed start, the evaluations before and after, saving (median-throughput run)")


def zoo_spec(spec: dict, arch: str, folder: Path, eval_prompts: int) -> dict:
    """The example's spec on the zoo model ``arch`` with a chat dataset written to ``folder``,
    at the settings the zoo's engine runs use (tests/workers/models/test_model_zoo_engine.py)."""
    from workers.models.modelzoo import ensure_zoo_model
    from workers.models.zoo_data import write_chat_dataset

    data = write_chat_dataset(folder / f"chat-{arch}.jsonl", 4200, two_digit=True)
    return merged(spec, {"model": {"path": str(ensure_zoo_model(arch, progress=True))},
                         "task": {"dataset": str(data), "size": 4000, "eval_size": 200},
                         "algorithm": {"lr": 1e-4, "warmup_steps": 2, "adv_std_norm": True},
                         "rollout": {"max_tokens": 16}, "eval": {"prompts": min(eval_prompts, 200)}})


def real_size_spec(spec: dict, folder: Path) -> dict:
    """The example's spec on Qwen2.5-0.5B's shape (built once, cached) with a chat dataset of
    sums written to ``folder``, at examples/own-model/real-size.yaml's model, algorithm, rollout
    and trainer settings; the schedule stays the example's (async; ``sync`` overrides it)."""
    from workers.models.zoo_data import write_chat_dataset
    from workers.models.realsize import ensure_shaped_model

    model = ensure_shaped_model("qwen2.5-0.5b")
    real = yaml.safe_load((ROOT / "examples" / "own-model" / "real-size.yaml").read_text())
    data = write_chat_dataset(folder / "chat-real-size.jsonl", 1200, two_digit=True)
    return merged(spec, {"model": {**real["model"], "path": str(model)},
                         "task": {"dataset": str(data), "size": 1000, "eval_size": 200},
                         "algorithm": real["algorithm"], "rollout": real["rollout"], "trainer": real["trainer"],
                         "schedule": {"batch_prompts": real["schedule"]["batch_prompts"]},
                         "eval": {"prompts": real["eval"]["prompts"]}})


def main() -> None:
    from workers.models.modelzoo import ARCHS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; medians are reported")
    p.add_argument("--minutes", type=float, default=4.0, help="training loop budget per system and round")
    p.add_argument("--eval-every", type=int, default=20, help="steps between held-out evaluations")
    p.add_argument("--eval-prompts", type=int, default=400, help="held-out prompts evaluated (200 at most on a zoo model)")
    p.add_argument("--target", type=float, default=None,
                   help="held-out accuracy to reach (default: the first system's after its budget, per round)")
    # A peer gets what FluxRL gets: FluxRL's engine and trainer use every core, so TRL and the
    # plain loop get as many torch threads by default. (One thread each, the old default, made
    # TRL look 1.5x slower than it is; --plain-threads 1 still measures that side.)
    p.add_argument("--plain-threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the plain loop and of TRL's (default: this machine's cores, as FluxRL uses)")
    p.add_argument("--quick", action="store_true", help="smoke check: 1 round of 15 s, 100 held-out prompts")
    p.add_argument("--model", default="tiny", choices=("tiny", *ARCHS, REAL_SIZE),
                   help="the tiny model (default), a zoo chat model of another architecture, or real-size "
                        "(Qwen2.5-0.5B's shape, random weights: samples/s only)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated, the target setter first: plain (tiny only), trl, {', '.join(ENGINE_SYSTEMS)} "
                        f"(default: {','.join(SYSTEMS)}; on a zoo model {','.join(ZOO_SYSTEMS)})")
    p.add_argument("--json", default=None, help="default: bench/results/vs_plain.json (vs_plain-MODEL.json on a zoo model)")
    args = p.parse_args()
    tiny = args.model == "tiny"
    default = SYSTEMS if tiny else REAL_SIZE_SYSTEMS if args.model == REAL_SIZE else ZOO_SYSTEMS
    systems = (args.systems or ",".join(default)).split(",")
    known = set(ENGINE_SYSTEMS) | set(OTHER_LOOPS) | ({"plain"} if tiny else set())
    if not set(systems) <= known or (tiny and systems[0] != "plain"):
        p.error(f"--systems: {'plain first, then ' if tiny else ''}any of {', '.join(sorted(known))}")
    if args.quick:
        args.rounds, args.minutes, args.eval_every, args.eval_prompts = 1, 0.25, 10, 100
    json_path = Path(args.json or BENCH / "results" / ("vs_plain.json" if tiny else f"vs_plain-{args.model}.json"))
    targets: list[float] = []

    with tempfile.TemporaryDirectory() as tmp:
        spec = merged(yaml.safe_load(EXAMPLE.read_text()), {
            "stop": {"max_minutes": args.minutes},
            "eval": {"every_steps": args.eval_every, "prompts": args.eval_prompts},
        })
        if args.model == REAL_SIZE:
            spec = real_size_spec(spec, Path(tmp))
        elif not tiny:
            spec = zoo_spec(spec, args.model, Path(tmp), args.eval_prompts)
        bar = tqdm(total=args.rounds * len(systems), desc="runs", unit="run", file=sys.stdout, dynamic_ncols=True)

        def one(system: str, tag: str) -> dict:
            if system == "plain":
                r = plain_run(spec, args.plain_threads)
            elif system == "trl":
                import multiprocessing

                from trl_grpo import trl_run

                # in a process of its own, as each engine run is: its model and Adam states are
                # freed when it ends (in this process they stayed, 8 GB at the real size, and
                # the next engine run had the rest of the machine's memory only); and wandb, which
                # TRL imports, patches that process's stdout, not this one's redirect below (here
                # its writes went round in circles: RecursionError)
                with multiprocessing.get_context("spawn").Pool(1) as pool:
                    r = pool.apply(trl_run, (spec, args.plain_threads))
            else:
                r = engine_run(system, spec, Path(tmp) / tag)
            if system == systems[0]:  # each round's first system sets the round's target
                targets.append(args.target if args.target is not None else r["accuracy_after"])
            r.update(train_s=r["seconds"] - r["eval_s"], outside_s=r["wall_s"] - r["seconds"], target=targets[-1])
            r.update(samples_per_s=r["trained_samples"] / r["train_s"], time_to_target_s=time_to(r["curve"], targets[-1]))
            bar.update(1)
            return r

        # interleaved() prints a line per run: through tqdm.write, so the bar stays below them
        with contextlib.redirect_stdout(DummyTqdmFile(sys.stdout)):
            runs = interleaved(systems, args.rounds, one)  # the target setter first in each round
        bar.close()
    summary = {name: summarize(rs) for name, rs in runs.items()}
    print_table(summary, targets, args)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"spec": spec, "args": vars(args), "targets": targets, "summary": summary,
                                     "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
