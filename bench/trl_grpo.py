"""TRL's GRPO (``trl.GRPOTrainer``, HF generate then a train step, one process) on the
same spec as bench/vs_plain.py's other systems: the tiny model, the example's task,
prompts per step, samples per prompt, learning rate and warm-up, no KL, token-mean
loss (TRL's ``dapo`` aggregation, FluxRL's ``normalize: tokens``), group advantages not
divided by their std (``scale_rewards: none``, FluxRL's ``adv_std_norm: false``), one
optimiser step per generated batch. Measured like the plain loop: the training clock
leaves the periodic held-out evaluations out.

With a chat model folder and a chat dataset (``bench/vs_plain.py --model qwen2``), TRL
gets the rows' ``messages`` as conversational prompts (its own chat-template rendering),
stops on the folder's end-of-turn ids, and is evaluated by HF greedy decoding of the
chat-rendered held-out prompts (``modelzoo.greedy_accuracy``, the warm start's measure).

A bench-only dependency, pinned: ``.venv/bin/pip install trl==1.16.0`` (it pulls
accelerate and datasets, not another torch).
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from workers.models import tinymodel
from workers.models.tinymodel import greedy_accuracy
from workers.tasks import builtin_rewards as rewards, datasets as tasks

TRL_VERSION = "1.16.0"


def trl_run(spec: dict, threads: int, vllm: bool = False) -> dict:
    """``vllm``: generate with TRL's vLLM colocate mode (``use_vllm``) instead of HF generate.
    The result's ``generation_s``: the time in TRL's generation and scoring of its batches."""
    try:
        import trl
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        raise SystemExit(f"the trl system needs TRL: .venv/bin/pip install trl=={TRL_VERSION} ({exc})") from None
    if trl.__version__ != TRL_VERSION:
        raise SystemExit(f"the trl system is pinned to TRL {TRL_VERSION}; this environment has {trl.__version__}")
    t_wall = time.time()
    torch.set_num_threads(threads)
    tiny = spec["model"]["path"] == "builtin:tiny"
    path = tinymodel.ensure_tiny_model() if tiny else Path(spec["model"]["path"])
    # FluxRL's trainer in bfloat16 at ZeRO 0 autocasts over fp32 weights: so does TRL's (bf16=True)
    autocast = spec["model"].get("dtype") == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    task, algo, rollout, schedule = spec["task"], spec["algorithm"], spec["rollout"], spec["schedule"]
    train, held = tasks.load_rows(task["dataset"], task["size"], task["eval_size"], task.get("seed", 0))
    held = held[:spec["eval"]["prompts"]]
    reward = rewards.BUILTIN_REWARDS[spec["reward"]["function"]]
    max_new, group, prompts = rollout["max_tokens"], algo["group_size"], schedule["batch_prompts"]
    if tiny:
        evaluate = lambda: greedy_accuracy(model, held, max_new)  # noqa: E731
    else:  # a zoo folder: its manifest names the architecture (its stop ids)
        from workers.models import modelzoo, realsize

        # a real-size folder (realsize.py) has the zoo qwen2's tokenizer and template
        arch = "qwen2" if (path / realsize.MANIFEST).exists() else json.loads((path / modelzoo.MANIFEST).read_text())["arch"]
        evaluate = lambda: modelzoo.greedy_accuracy(model, tokenizer, held, arch, max_new)  # noqa: E731

    def text(turns) -> str:  # a conversational prompt or completion is a message list: its last turn
        return turns if isinstance(turns, str) else turns[-1]["content"]

    def score(prompts, completions, answer, **_):
        return [reward(text(p), text(c), a) for p, c, a in zip(prompts, completions, answer)]

    budget_s, every = 60 * spec["stop"]["max_minutes"], spec["eval"]["every_steps"]
    clock = {"start": None, "eval_s": 0.0, "steps": 0, "generation_s": 0.0}
    curve: list[tuple[float, float]] = []

    class Budget(TrainerCallback):
        """Stops at the time budget (checked after each step, as the engine checks before
        the next) and evaluates every ``every`` steps, off the clock."""

        def on_train_begin(self, args, state, control, **kwargs):
            clock["start"] = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            clock["steps"] = state.global_step
            if every and state.global_step % every == 0:
                t_eval = time.time()
                curve.append((t_eval - clock["start"] - clock["eval_s"], evaluate()))
                clock["eval_s"] += time.time() - t_eval
            if time.time() - clock["start"] > budget_s:
                control.should_training_stop = True
            return control

    before = evaluate()
    curve.append((0.0, before))
    with tempfile.TemporaryDirectory(prefix="fluxrl-trl-") as out:
        config = GRPOConfig(
            output_dir=out, seed=spec.get("seed", 0), use_cpu=True, bf16=autocast, report_to=[], save_strategy="no",
            logging_steps=10 ** 9, dataloader_num_workers=0, disable_dropout=True, max_steps=10 ** 6,
            learning_rate=algo["lr"], lr_scheduler_type="constant_with_warmup", warmup_steps=algo.get("warmup_steps", 10),
            adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0, max_grad_norm=1.0,
            per_device_train_batch_size=prompts * group, num_generations=group, steps_per_generation=1,
            max_completion_length=max_new, temperature=rollout["temperature"], top_p=1.0, top_k=0,
            beta=0.0, num_iterations=1, loss_type="dapo",
            scale_rewards="group" if algo.get("adv_std_norm") else "none",
            **({"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3} if vllm else {}))
        dataset = Dataset.from_list([{"prompt": r["prompt"] if tiny else r["messages"], "answer": r["answer"]}
                                     for r in train])
        class Timed(GRPOTrainer):
            """Times TRL's generation and scoring of each batch (the rest of a step is training)."""

            def _generate_and_score_completions(self, *args, **kwargs):
                t0 = time.time()
                try:
                    return super()._generate_and_score_completions(*args, **kwargs)
                finally:
                    clock["generation_s"] += time.time() - t0

        trainer = Timed(model=model, reward_funcs=score, args=config, train_dataset=dataset,
                        processing_class=tokenizer, callbacks=[Budget()])
        trainer.train()
    seconds = time.time() - clock["start"]
    after = evaluate()
    curve.append((seconds - clock["eval_s"], after))
    return {"system": "trl_vllm" if vllm else "trl", "steps": clock["steps"], "generation_s": clock["generation_s"], "trained_samples": clock["steps"] * prompts * group,
            "seconds": seconds, "eval_s": clock["eval_s"], "accuracy_before": before, "accuracy_after": after,
            "curve": curve, "wall_s": time.time() - t_wall, "threads": threads, "trl": trl.__version__}
