"""Ablation of the long-tail techniques on the long-tailed chain task: the same spec with
each technique off/on, one after another in one invocation.

    .venv/bin/python bench/ablation.py [--set techniques|dispatch|fusion|mechanisms|pipeline] [--steps 20] [--rounds 3]

- ``techniques`` (one engine): stream training (StreamRL's stream generation); fused
  scoring (per-sample rule scoring during generation, a simplified relative of RLHFuse's
  inter-stage fusion); longest-first (a task order).
- ``dispatch`` (two engines): fifo, longest-first, and skew-aware dispatch (StreamRL's:
  one engine for the predicted-long groups, vLLM priorities with aging), sync and async.
- ``fusion`` (two engines, RLHF with the inference stage: reward model, reference,
  critic): inference after a barrier, per sample as each finishes, with the step's tail
  gathered onto one engine (RLHFuse's inter-stage fusion) or spread (migrate_tail), and
  async. Prints the share of inference done before the last sample finished generating.
- ``mechanisms`` (the same RLHF runs): the mechanisms added one on top of the other, plain
  sync, + stream training, + skew-aware dispatch, + tail gathering, + intra-stage fusion
  (the trainer as a fused 2-stage actor-critic pipeline; it steps on whole batches, so stream
  training is off in that row), then async.
- ``pipeline`` (the same RLHF runs, sync): the trainer as DeepSpeed's (actor and critic one
  after the other in one process), as two 2-stage pipelines one after the other, and as
  RLHFuse's fused pipeline. Prints the pipeline's bubble share.

Every configuration runs with ``max_num_seqs: 16`` (fewer sequences than a step's 64
samples), so requests queue in the engine as on a loaded GPU and dispatch order matters.
Prints trained samples/s, the ratio to the first row, the idle share of generation and
training over the run, the ranker's quality (Spearman ρ, top-decile recall) and the long
tail's share of generation time (after 90 % of a step's samples had finished).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from sync_vs_async import BASE, ROOT, interleaved, median_run, merged, run

# Throughput only: no held-out evaluation before and after (it is not timed, but costs minutes).
QUEUED = merged(BASE, {"rollout": {"max_num_seqs": 16}, "eval": {"prompts": 0}})
TWO = {"rollout": {"engines": 2}}
# RLHFuse's inference stage whole: a reward model, the KL reference's and the critic's forwards,
# each in a worker of its own beside the two engines
RLHF = {**TWO, "schedule": {"mode": "sync"},
        "reward": {"function": "sum",
                   "components": [{"function": "model", "weight": 1.0}, {"function": "numeric_match", "weight": 0.0}],
                   "model": {"path": "builtin:tiny-rm", "micro_batch": 32, "max_wait_ms": 20}},
        "algorithm": {"advantage": "gae", "kl_coef": 0.01, "kl_reference": "stage"},
        "critic": {"forward": "stage"}}
SETS = {"techniques": {
    "sync (plain: barrier scoring, fifo)": {"schedule": {"mode": "sync"}, "rollout": {"fused_scoring": False}},
    "sync + fused scoring": {"schedule": {"mode": "sync"}},
    "sync + longest-first dispatch": {"schedule": {"mode": "sync", "dispatch": "longest_first"}},
    "sync + stream training": {"schedule": {"mode": "sync", "stream_train": True}},
    "sync + stream + longest-first": {"schedule": {"mode": "sync", "stream_train": True, "dispatch": "longest_first"}},
    "async keep": {"schedule": {"mode": "async"}},
    "async keep + longest-first": {"schedule": {"mode": "async", "dispatch": "longest_first"}},
}, "dispatch": {
    "sync, 2 engines, fifo": {**TWO, "schedule": {"mode": "sync"}},
    "sync, 2 engines, longest-first": {**TWO, "schedule": {"mode": "sync", "dispatch": "longest_first"}},
    "sync, 2 engines, skew-aware": {**TWO, "schedule": {"mode": "sync", "dispatch": "skew_aware"}},
    "async, 2 engines, fifo": {**TWO, "schedule": {"mode": "async"}},
    "async, 2 engines, skew-aware": {**TWO, "schedule": {"mode": "async", "dispatch": "skew_aware"}},
}, "fusion": {
    "sync RLHF, inference after the barrier": {**RLHF, "rollout": {**TWO["rollout"], "fused_scoring": False}},
    "sync RLHF, inference per sample as it finishes": RLHF,
    "+ tail gathered onto one engine": {**RLHF, "rollout": {**TWO["rollout"], "gather_tail": 16}},
    "+ tail spread to the idlest (migrate_tail)": {**RLHF, "rollout": {**TWO["rollout"], "migrate_tail": 16}},
    "async RLHF": {**RLHF, "schedule": {"mode": "async"}},
}, "mechanisms": {
    "plain sync (inference after the barrier, fifo)": {**RLHF, "rollout": {**TWO["rollout"], "fused_scoring": False}},
    "+ stream training (inference per sample)": {**RLHF, "schedule": {"mode": "sync", "stream_train": True}},
    "+ skew-aware dispatch": {**RLHF, "schedule": {"mode": "sync", "stream_train": True, "dispatch": "skew_aware"}},
    "+ tail gathering (inter-stage fusion)": {**RLHF, "rollout": {**TWO["rollout"], "gather_tail": 16},
                                              "schedule": {"mode": "sync", "stream_train": True,
                                                           "dispatch": "skew_aware"}},
    # the pipeline steps on whole batches: stream training off here (it is refused with a pipeline)
    "+ intra-stage fusion (fused pipeline, no streaming)": {
        **RLHF, "rollout": {**TWO["rollout"], "gather_tail": 16}, "trainer": {"pipeline": {"stages": 2}},
        "schedule": {"mode": "sync", "dispatch": "skew_aware"}},
    "async (skew-aware)": {**RLHF, "schedule": {"mode": "async", "dispatch": "skew_aware"}},
}, "pipeline": {
    "sync RLHF, DeepSpeed trainer (actor, then critic)": RLHF,
    "sync RLHF, 2-stage pipelines one after the other": {**RLHF, "trainer": {"pipeline": {
        "stages": 2, "schedule": "sequential"}}},
    "sync RLHF, 2-stage fused pipeline (intra-stage fusion)": {**RLHF, "trainer": {"pipeline": {"stages": 2}}},
}}


def shown(r: dict, key: str, form: str = ".2f") -> str:
    return format(r[key], form) if r.get(key) is not None else "-"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--set", default="techniques", choices=sorted(SETS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1, help="interleaved repetitions; the median run is reported")
    p.add_argument("--json", default=None, help="default: bench/results/ablation.json (dispatch: ablation_dispatch.json)")
    args = p.parse_args()
    configs = SETS[args.set]
    args.json = args.json or str(ROOT / "bench" / "results" /
                                 ("ablation.json" if args.set == "techniques" else f"ablation_{args.set}.json"))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        names = list(configs)
        runs = interleaved(names, args.rounds, lambda name, tag: run(
            f"ablation{names.index(name)}", args.steps, Path(tmp) / tag, configs[name], base=QUEUED))
        results = [{"config": name, **median_run(rs)} for name, rs in runs.items()]
    base = results[0]["samples_per_s"]
    print(f"\n{'configuration':<52} {'samples/s':>9} {'(min–max)':>15} {'× sync':>7} {'idle gen':>9} "
          f"{'idle train':>10} {'ranker ρ':>8} {'top-10%':>7} {'tail':>5} {'overlap':>7} {'train tok/s':>11} {'bubble':>6}")
    for r in results:
        rho = f"{r['spearman']:.2f}" if r.get("spearman") is not None else "-"
        recall = f"{r['top10_recall']:.2f}" if r.get("top10_recall") is not None else "-"
        spread = f"{r['samples_per_s_min']:.1f}–{r['samples_per_s_max']:.1f}"
        print(f"{r['config']:<52} {r['samples_per_s']:>9.2f} {spread:>15} {r['samples_per_s'] / base:>7.2f} "
              f"{r['idle_generation']:>9.2f} {r['idle_training']:>10.2f} {rho:>8} {recall:>7} "
              f"{r['long_tail_share']:>5.2f} {shown(r, 'overlap'):>7} {shown(r, 'trainer_tokens_per_s', '.0f'):>11} "
              f"{shown(r, 'bubble'):>6}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
