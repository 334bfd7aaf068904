"""FluxRL engine CLI (no web app needed).

  python -m workers bootstrap [--rebuild]     install the tiny model (shipped weights, checked
                                              against their SHA-256) or retrain its recipe; print its folder
  python -m workers validate spec.yaml        check a run spec, naming any bad field
  python -m workers sandbox-check             prove reward code can be contained here (or say why not)
  python -m workers evaluate MODEL spec.yaml  held-out accuracy of a model folder by HF greedy generation
  python -m workers build-model ARCH [--out DIR] [--dataset F]
                                              a small qwen2/llama/gpt2 with its own tokenizer, warm-started
  python -m workers run spec.yaml [--out DIR] [--platform URL --token T --run-id N] [--resume]
                                              (or the token in FLUXRL_RUN_TOKEN)

--resume continues from the newest complete checkpoint in DIR/checkpoints (saved every
trainer.checkpoint_every steps): step N+1 onwards, metrics.jsonl cut back to step N.
SIGTERM lets the step in progress finish, saves a checkpoint after it and stops (exit 130),
so --resume loses nothing; a second SIGTERM, or SIGINT, stops at once.

``model.path: builtin:tiny`` in a spec means the tiny model (built on first use).
Exit codes: 0 done, 2 bad input (spec, dataset, model, reward), 1 failure, 130 stopped.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

RUN_TOKEN_ENV = "FLUXRL_RUN_TOKEN"
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
log = logging.getLogger(__name__)
HEARTBEAT_S = 15.0  # the platform fails a run unheard of for 60 s (FLUXRL_RUN_STALE_S)


def configure_logging() -> None:
    """Diagnostics (workers/io/report.py, heartbeat.py, the controller...) go to stderr, one
    line each as "LEVEL logger: text": under the platform stderr is the run's engine.log,
    whose tail the dashboard shows (platform/fluxrl/runs/dispatch.py). A command's own answer
    is printed, not logged."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)


def cmd_run(args) -> int:
    from workers.io.heartbeat import Heartbeat
    from workers.io.report import PlatformClient, Reporter
    from workers.rewards.service import RewardFunctionBroken
    from workers.rewards.sandbox import RewardCodeError
    from workers.spec import SpecError, load_spec_file
    from workers.tasks.datasets import DatasetError

    # --token, else the environment (how the platform's dispatcher passes it: argv is
    # visible in ps). Removed from the environment either way, so that the vLLM, trainer
    # and reward processes started from here never see it.
    token = args.token or os.environ.pop(RUN_TOKEN_ENV, None)
    os.environ.pop(RUN_TOKEN_ENV, None)
    if args.platform and not token:
        print(f"error: --platform needs a run token: --token or {RUN_TOKEN_ENV}", file=sys.stderr)
        return 2
    platform = PlatformClient(args.platform, token, args.run_id) if args.platform else None
    out = Path(args.out or f"var/runs/{time.strftime('%Y%m%d-%H%M%S')}")

    def fail(reason: str, code: int) -> int:
        print(f"error: {reason}", file=sys.stderr)
        if platform:
            try:
                platform.status("failed", reason)
            except Exception as exc:  # the platform will notice the process exit anyway
                log.warning("could not report the failure: %s", exc)
        return code

    try:
        spec = load_spec_file(args.spec)
    except SpecError as exc:
        return fail(f"invalid run spec: {exc}", 2)
    except OSError as exc:
        return fail(f"cannot read the spec: {exc}", 2)
    # model.path is resolved once, by the Controller's set-up (a ModelCheckError there exits 2)
    from workers.spec import PASSIVE_WAITS, shares_cores

    if shares_cores(spec):  # before torch starts OpenMP in this process (the trainer's threads)
        os.environ.update(PASSIVE_WAITS)
    from workers.coord.controller import Controller
    resume = None
    if args.resume and not args.out:
        return fail("--resume needs --out: the folder of the run to continue", 2)
    if args.resume:
        from workers.io.checkpoint import checkpoints_dir, latest_checkpoint, truncate_metrics

        resume = latest_checkpoint(out)
        # Points after the checkpoint are computed again (before the Reporter appends).
        dropped = truncate_metrics(out / "metrics.jsonl", resume.step if resume else -1)
        if resume is None:
            log.info("--resume: no complete checkpoint in %s; starting from scratch%s", checkpoints_dir(out),
                     f" (dropped {dropped} metric points of the earlier attempt)" if dropped else "")
        else:
            log.info("--resume: continuing from %s (step %s, policy version %s); dropped %s metric points after step %s",
                     resume.path, resume.step, resume.version, dropped, resume.step)
    reporter = Reporter(out / "metrics.jsonl", platform)
    if resume is not None and platform:
        # The platform may lack points up to the checkpoint (a checkpoint saved while it was
        # away, or not yet reported when the run died): send them again; it skips what it has.
        from workers.io.checkpoint import read_metrics

        reporter.resend(read_metrics(out / "metrics.jsonl"))
    on_checkpoint = None
    if platform:
        checkpoints = PlatformClient(args.platform, token, args.run_id)  # used from a thread of its own

        def on_checkpoint(step: int, version: int, path: str) -> None:
            checkpoints.post("checkpoints", {"step": step, "version": version, "path": path})
    heartbeat = None
    if platform:
        # After --resume the platform drops its points and samples past the step this engine
        # continues after: the newest checkpoint on disk, whether or not its report got through.
        platform.status("running", "", **({"resumed_from_step": resume.step if resume else -1} if args.resume else {}))
        # A client of its own: the Reporter's session is used from its own thread.
        heartbeat = Heartbeat(PlatformClient(args.platform, token, args.run_id), every_s=HEARTBEAT_S).start()

    async def main():
        stop, signalled = asyncio.Event(), []

        def on_signal():  # cooperative stop: engines shut down, metrics flushed
            signalled.append(True)
            stop.set()

        controller = Controller(spec, out, reporter, progress=not args.no_progress, stop_event=stop,
                                resume=resume, on_checkpoint=on_checkpoint, rendezvous=getattr(args, "rendezvous", None))

        def on_term():  # finish the step, save a checkpoint, stop (--resume continues from it)
            signalled.append(True)
            controller.request_checkpoint_and_stop()

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, on_signal)
        loop.add_signal_handler(signal.SIGTERM, on_term)
        if heartbeat:  # a cancel asked for on the platform stops the run like SIGINT
            heartbeat.on_cancel = lambda: loop.call_soon_threadsafe(on_signal)
            heartbeat.extra = controller.engine_pools  # rollout.share_engines: the pools this run is on
        result = await controller.run()
        return result, bool(signalled)

    try:
        result, stopped = asyncio.run(main())
    except (SpecError, DatasetError, FileNotFoundError, RewardCodeError, RewardFunctionBroken, ValueError) as exc:
        reporter.close()
        return fail(str(exc), 2)
    except Exception as exc:
        reporter.close()
        return fail(f"{type(exc).__name__}: {exc}", 1)
    finally:
        if heartbeat:
            heartbeat.stop()
    reporter.close()
    summary = {
        "steps": result.steps, "trained_samples": result.trained_samples, "seconds": round(result.seconds, 1),
        "samples_per_s": round(result.samples_per_s, 3), "accuracy_before": result.accuracy_before,
        "accuracy_after": result.accuracy_after, "sampled_reward_before": result.sampled_reward_before,
        "sampled_reward_after": result.sampled_reward_after, "staleness_max": result.staleness_max,
        "dropped_stale": result.dropped_stale, "dropped_uniform": result.dropped_uniform,
        "final_model": result.final_model,
        "idle_generation": round(result.idle_generation, 3), "idle_training": round(result.idle_training, 3),
        "skipped_prompts": result.skipped_prompts,
        "memory_peak_gib": result.memory_peak_gib,  # per process on this node (VmHWM)
        "memory_plan_gib": result.memory_plan_gib,  # the host-memory planner's figure per process (CPU plans)
        **({"exporters": result.exporters} if result.exporters else {}),  # report.*: "ok" or why one was dropped
    }
    (out / "result.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    if platform and heartbeat.cancelled:
        platform.status("cancelled", "")
    elif platform and not stopped:
        platform.status("succeeded", "")
    return 130 if stopped else 0


def cmd_plan(args) -> int:
    from workers.cluster.placement import Machine, ModelSize, PlacementError, detect_machine, model_size, \
        plan_placement
    from workers.spec import SpecError, load_spec_file
    from workers.models.preflight import resolve_model_path

    try:
        spec = load_spec_file(args.spec)
    except SpecError as exc:
        print(f"invalid run spec: {exc}", file=sys.stderr)
        return 2
    here = detect_machine()
    machine = Machine(cpu_cores=args.cpu_cores or here.cpu_cores,
                      gpus_per_node=here.gpus_per_node if args.gpus is None else args.gpus,
                      gpu_memory_gib=here.gpu_memory_gib if args.gpus is None else args.gpu_memory_gib,
                      host_memory_gib=here.host_memory_gib)
    try:
        model = ModelSize(args.params) if args.params else model_size(resolve_model_path(spec.model.path), spec.model.lora)
        if spec.reward.model is not None:  # its folder, so that the plan counts its size on its GPU
            from workers.models.reward_model import resolve_reward_model_path

            with contextlib.suppress(ValueError, OSError):  # not a local folder: planned as of unknown size
                spec.reward.model.path = resolve_reward_model_path(spec.reward.model.path)
        print(plan_placement(spec, machine, model).describe())
    except (PlacementError, ValueError, OSError) as exc:
        print(f"does not fit: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bootstrap", help="install the tiny model (or --rebuild it from its recipe)")
    b.add_argument("--root", default=None, help="model cache (default: $FLUXRL_MODEL_CACHE or ~/.cache/fluxrl/models)")
    b.add_argument("--rebuild", action="store_true",
                   help="retrain the warm start from its recipe (minutes) instead of installing the shipped weights")
    m = sub.add_parser("build-model", help="build a small model of another architecture, with its own trained "
                       "tokenizer and chat template, warm-started on chat arithmetic (workers/models/modelzoo.py)")
    m.add_argument("arch", choices=["qwen2", "llama", "gpt2", "qwen2-tools"],
                   help="qwen2-tools: the zoo Qwen2 with Qwen2's tool format, warm-started to call a calculator "
                        "(workers/models/toolzoo.py; model.path builtin:qwen2-tools)")
    m.add_argument("--out", default=None, help="folder to write (default: the model cache, reused when built)")
    m.add_argument("--steps", type=int, default=None, help="warm-start steps (default: the recipe's)")
    m.add_argument("--dataset", default=None, help="also write a chat JSONL dataset of the same task here")
    m.add_argument("--rows", type=int, default=2000, help="rows of --dataset")
    m.add_argument("--shape", default=None, choices=["qwen2.5-0.5b", "qwen2.5-1.5b"],
                   help="qwen2 only: that published model's exact configuration (vocabulary 151,936) with random "
                        "weights and the zoo qwen2's tokenizer, to measure size (it learns nothing); needs --out")
    rm = sub.add_parser("build-reward-model", help="install the tiny reward model (reward.model.path builtin:tiny-rm), "
                        "or --rebuild it from its recipe; prints its folder")
    rm.add_argument("--root", default=None, help="model cache (default: $FLUXRL_MODEL_CACHE or ~/.cache/fluxrl/models)")
    rm.add_argument("--rebuild", action="store_true", help="train the recipe even where shipped weights exist")
    rm.add_argument("--ship", action="store_true", help="(maintainers) copy the result into workers/assets/tiny-rm")
    v = sub.add_parser("validate", help="validate a run spec")
    v.add_argument("spec")
    pl = sub.add_parser("plan", help="where a spec's processes would run and, on GPUs, what each GPU would hold, on "
                        "a machine you describe (default: this one); nothing starts. Exit 2 if it does not fit")
    pl.add_argument("spec")
    pl.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: this machine's)")
    pl.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of each GPU (with --gpus)")
    pl.add_argument("--cpu-cores", type=int, default=None, help="CPU cores per node (default: this machine's)")
    pl.add_argument("--params", type=int, default=None, help="the model's parameters, where model.path is not a "
                    "local folder (a hub id); its shape is then unknown (no activations or logits counted)")
    e = sub.add_parser("evaluate", help="held-out accuracy of a model folder with plain HF greedy generation "
                       "(no vLLM), using the spec's dataset, prompt format and reward")
    e.add_argument("model", help="a model folder, e.g. RUN_DIR/final_model")
    e.add_argument("spec")
    e.add_argument("--prompts", type=int, default=None, help="held-out rows to use (default: the spec's eval.prompts)")
    r = sub.add_parser("run", help="run a training from a spec")
    r.add_argument("spec")
    r.add_argument("--out", default=None, help="output folder (metrics.jsonl, result.json, final_model/)")
    r.add_argument("--platform", default=None, help="platform base URL to report to")
    r.add_argument("--token", default=None, help=f"run-scoped API token (default: ${RUN_TOKEN_ENV}, which keeps it out of ps)")
    r.add_argument("--run-id", default=None)
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--rendezvous", default=None, help="resources.nodes > 1: HOST:PORT this node (0) listens on for "
                   "the other nodes' agents (default: $FLUXRL_RENDEZVOUS); all share $FLUXRL_CLUSTER_KEY")
    r.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --out (from scratch if there is none)")
    n = sub.add_parser("node", help="join a run over several nodes as node R: start this node's trainer ranks and "
                       "rollout engines and serve the coordinator (workers/cluster/node.py)")
    n.add_argument("--rendezvous", required=True, help="HOST:PORT of node 0 (its python -m workers run --rendezvous)")
    n.add_argument("--node-rank", type=int, required=True, help="this node's rank, 1 .. resources.nodes - 1")
    n.add_argument("--out", default=None, help="the run's folder on this node: trainer state is loaded and saved only "
                   "inside it (default: the folder node 0 names, the same path on a shared file system)")
    n.add_argument("--host", default=None, help="this node's address the others reach (default: the one that "
                   "routes to the rendezvous)")
    sub.add_parser("sandbox-check", help="start one contained sandbox to prove reward code can run here; print "
                   "'sandbox: proven' or 'sandbox: unavailable: <why>' (exit 0 / 1)")
    sub.add_parser("engine-server", help="(started by the run) one rollout engine serving the run's coordinator; "
                   "reads its EngineServerConfig as JSON on stdin (workers/rollout/server.py)")
    sub.add_parser("engine-pool", help="(started by a run with rollout.share_engines) one shared rollout engine "
                   "serving the LoRA runs of any team on this node; reads its PoolConfig as JSON on stdin "
                   "(workers/rollout/pool.py)")
    args = p.parse_args(argv)
    configure_logging()
    if args.cmd == "node":
        from workers.cluster.node import run_node

        return run_node(args.rendezvous, args.node_rank, args.host, args.out)
    if args.cmd == "sandbox-check":
        from workers.rewards.sandbox_boundary import sandbox_status

        available, reason = sandbox_status()
        print(f"sandbox: {reason}" if available else f"sandbox: unavailable: {reason}")
        return 0 if available else 1
    if args.cmd == "engine-pool":
        from workers.rollout.pool import serve_pool
        from workers.rollout.pool_registry import PoolConfig

        return serve_pool(PoolConfig.model_validate_json(sys.stdin.read()))
    if args.cmd == "engine-server":
        from workers.rollout.messages import EngineServerConfig
        from workers.rollout.server import serve

        return serve(EngineServerConfig.model_validate_json(sys.stdin.read()))
    if args.cmd == "bootstrap":
        from workers.models.tinymodel import MANIFEST, ensure_tiny_model

        folder = ensure_tiny_model(args.root, rebuild=args.rebuild)
        if args.rebuild:
            built = json.loads((folder / MANIFEST).read_text())
            same = built.get("same_as_shipped")
            print(f"rebuilt: demo held-out greedy accuracy {built['demo_accuracy']:.4f}, sha256 {built['sha256'][:12]}..."
                  + ("" if same is None else " (identical to the shipped weights)" if same
                     else " (differs from the shipped weights: another CPU model rounds differently)"))
        print(folder)
        return 0
    if args.cmd == "build-reward-model":
        from workers.models.reward_model import MANIFEST as RM_MANIFEST, ensure_tiny_reward_model, ship

        folder = ensure_tiny_reward_model(args.root, rebuild=args.rebuild)
        built = json.loads((folder / RM_MANIFEST).read_text())
        print(f"reward model: held-out accuracy {built['held_out_accuracy']:.3f} on {built['held_out_texts']} texts "
              f"({built['held_out_right_share']:.0%} right answers), sha256 {built['sha256'][:12]}...", file=sys.stderr)
        if args.ship:
            ship(folder)
        print(folder)
        return 0
    if args.cmd == "build-model" and args.shape:
        from workers.models.modelzoo import ensure_zoo_model
        from workers.models.realsize import build_shaped_model

        if args.arch != "qwen2" or not args.out:
            print("--shape builds a qwen2 model and needs --out", file=sys.stderr)
            return 2
        print(build_shaped_model(args.shape, args.out, ensure_zoo_model("qwen2", progress=True)))
        return 0
    if args.cmd == "build-model" and args.arch == "qwen2-tools":
        from workers.models.toolzoo import MANIFEST as TOOL_MANIFEST, build_tool_model, ensure_tool_model

        folder = (build_tool_model(args.out, steps=args.steps, progress=True) if args.out
                  else ensure_tool_model(steps=args.steps, progress=True))
        built = json.loads((Path(folder) / TOOL_MANIFEST).read_text())
        print(f"{args.arch}: {built['params']:,} parameters, held-out greedy accuracy {built['held_out_accuracy']:.3f} "
              f"with the calculator, {built['held_out_accuracy_no_tools']:.3f} without", file=sys.stderr)
        print(folder)
        return 0
    if args.cmd == "build-model":
        from workers.models.modelzoo import MANIFEST as ZOO_MANIFEST, build_zoo_model, ensure_zoo_model
        from workers.models.zoo_data import write_chat_dataset

        if args.out:
            folder = build_zoo_model(args.arch, args.out, steps=args.steps, progress=True)
        else:
            folder = ensure_zoo_model(args.arch, steps=args.steps, progress=True)
        built = json.loads((Path(folder) / ZOO_MANIFEST).read_text())
        print(f"{args.arch}: {built['params']:,} parameters, {built['len_tokenizer']} tokens, held-out greedy "
              f"accuracy {built['held_out_accuracy']:.3f} after the warm start", file=sys.stderr)
        if args.dataset:
            write_chat_dataset(args.dataset, args.rows, seed=7, two_digit=True)
            print(f"dataset: {args.dataset} ({args.rows} chat rows of sums with a 2-digit operand)", file=sys.stderr)
        print(folder)
        return 0
    if args.cmd == "evaluate":
        from workers.models.hf_eval import evaluate_folder
        from workers.spec import SpecError, load_spec_file

        try:
            print(json.dumps(evaluate_folder(args.model, load_spec_file(args.spec), args.prompts), indent=2))
        except (SpecError, ValueError, OSError) as exc:  # bad input: the spec, its dataset, the folder
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "plan":
        return cmd_plan(args)
    if args.cmd == "validate":
        from workers.spec import SpecError, load_spec_file

        try:
            load_spec_file(args.spec)
        except SpecError as exc:
            print(f"invalid run spec: {exc}", file=sys.stderr)
            return 2
        print("ok")
        return 0
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
