"""The tiny reward model (``reward.model.path: builtin:tiny-rm``), built from the tiny policy
the way RLHF builds one from its SFT model: the policy's Qwen2 body under a one-label
classification head (``Qwen2ForSequenceClassification``), trained to tell right from wrong
answers to the demo's task (2-digit additions).

Its training texts are prompt + completion, as the reward model reads them in a run
(workers/rewards/model.py ``Scorer``): half are the tiny policy's own samples at
temperature 1, labelled right or wrong by the exact answer (the mistakes RL will meet),
half are the exact answer or a near miss (off by 1, 2, 9, 10, 11 or a random amount),
balanced. Its held-out accuracy, on prompts and samples drawn apart from the training
ones, is recorded in the manifest and stated in docs/engine.md.

Like the tiny policy, the default recipe's weights ship with the project
(``workers/assets/tiny-rm``): the same recipe trained on another CPU gives another model.
``python -m workers build-reward-model --rebuild`` retrains it.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

import torch

from workers.models import tinymodel
from workers.models.tinymodel import (MANIFEST, WEIGHTS, cache_is_good, default_cache, file_sha256, install_folder,
                                      recipe_id, shipped_manifest, verify_model_folder)
from workers.tasks import datasets as tasks
from workers.tasks.builtin_rewards import numeric_match
from workers.tasks.model_folder import UnsafeModelFolder, check_model_folder

logger = logging.getLogger(__name__)

BUILTIN = "builtin:tiny-rm"
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny-rm"

DEFAULT_RECIPE = {
    "seed": 0,
    "task": "add",
    "params": {"max_digits": 2},
    "examples": 200_000,  # training texts; one pass over them
    "held_out": 2_000,
    "policy_share": 0.5,  # of the texts, the policy's own samples; the rest exact answers or near misses
    "batch": 64,
    # By measurement (held-out accuracy after N steps): lr 3e-3 stalled at 0.67 (2300),
    # 1e-3 reached 0.74 (1250), 5e-4 0.77 (1800) and still rising, so 5e-4 over 3125 steps.
    "lr": 5e-4,
    "final_lr_ratio": 0.1,
}


class RewardModelBuildError(RuntimeError):
    pass


def resolve_reward_model_path(path: str) -> str:
    """``builtin:tiny-rm`` (built or installed on first use), or a local folder holding a
    one-label sequence-classification model; anything else is a ModelCheckError."""
    from workers.models.preflight import ModelCheckError

    if path == BUILTIN:
        return str(ensure_tiny_reward_model())
    if not os.path.isdir(path):
        raise ModelCheckError(f"reward.model.path {path!r} is not a folder (a Hugging Face sequence-classification "
                              f"model, or {BUILTIN})")
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ModelCheckError(f"reward.model.path {path!r} has no readable config.json ({exc})") from None
    archs = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ModelCheckError(f"reward.model.path {path!r}: architecture {', '.join(archs) or '(none)'} is not a "
                              "sequence classifier (*ForSequenceClassification)")
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    if labels != 1:
        raise ModelCheckError(f"reward.model.path {path!r} has {labels} labels; a reward model has one (its logit)")
    try:
        return check_model_folder(path)
    except UnsafeModelFolder as exc:
        raise ModelCheckError(f"reward.model.path: {exc}") from None


def _near_miss(answer: int, rng: random.Random) -> int:
    delta = rng.choice([1, -1, 2, -2, 9, -9, 10, -10, 11, -11, 0])
    if delta == 0:
        delta = rng.randint(-50, 50) or 3
    return answer + delta if answer + delta >= 0 else answer + abs(delta)


def training_texts(policy, tokenizer, recipe: dict, n: int, seed: int) -> list[tuple[str, float]]:
    """(prompt + completion, 1.0 if right else 0.0) for ``n`` prompts of the recipe's task,
    the same for the same seed (the policy samples under torch's seed ``seed``)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows = tasks.generate(recipe["task"], n, seed=seed, **recipe["params"])
    sampled = [i for i in range(n) if rng.random() < recipe["policy_share"]]
    texts: dict[int, tuple[str, float]] = {}
    for start in range(0, len(sampled), 256):
        chunk = sampled[start:start + 256]
        outs = tinymodel.complete(policy, [rows[i]["prompt"] for i in chunk], 8, temperature=1.0)
        for i, ids in zip(chunk, outs):
            text = tinymodel.decode([t for t in ids if t != tinymodel.EOS_ID])
            texts[i] = (rows[i]["prompt"] + text, numeric_match(rows[i]["prompt"], text, rows[i]["answer"]))
    for i, row in enumerate(rows):
        if i not in texts:
            right = rng.random() < 0.5
            answer = int(row["answer"]) if right else _near_miss(int(row["answer"]), rng)
            texts[i] = (row["prompt"] + str(answer), 1.0 if right else 0.0)
    return [texts[i] for i in range(n)]


def _batch(tokenizer, examples: list[tuple[str, float]], pad_id: int):
    seqs = [tokenizer(t, add_special_tokens=True)["input_ids"] for t, _ in examples]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask, torch.tensor([y for _, y in examples])


@torch.no_grad()
def accuracy(model, tokenizer, examples: list[tuple[str, float]], pad_id: int) -> float:
    """Share of texts the model classifies right (logit > 0 means "right answer")."""
    was = model.training
    model.eval()
    correct = 0
    for i in range(0, len(examples), 500):
        ids, mask, y = _batch(tokenizer, examples[i:i + 500], pad_id)
        correct += int(((model(input_ids=ids, attention_mask=mask).logits[:, 0] > 0).float() == y).sum())
    model.train(was)
    return correct / max(1, len(examples))


def train(recipe: dict, out: Path, progress: bool = True) -> dict:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    torch.set_num_threads(1)  # reproducible, and polite on a busy machine
    torch.manual_seed(recipe["seed"])
    policy_dir = check_model_folder(tinymodel.ensure_tiny_model(progress=progress))
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    t0 = time.time()
    examples = training_texts(policy, tokenizer, recipe, recipe["examples"], seed=recipe["seed"] + 1)
    held_out = training_texts(policy, tokenizer, recipe, recipe["held_out"], seed=recipe["seed"] + 99)
    model = AutoModelForSequenceClassification.from_pretrained(policy_dir, num_labels=1)
    pad = tokenizer.pad_token_id
    model.config.pad_token_id = pad
    start_accuracy = accuracy(model, tokenizer, held_out, pad)
    steps = recipe["examples"] // recipe["batch"]
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=0.01)
    floor = recipe["final_lr_ratio"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(floor, 1 - s / steps))

    def batch_loss(step: int):
        ids, mask, y = _batch(tokenizer, examples[step * recipe["batch"]:(step + 1) * recipe["batch"]], pad)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, 0]
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, y)

    _, loss = tinymodel.supervised_steps(model, opt, sched, steps, batch_loss, desc="reward model", progress=progress)
    held = accuracy(model, tokenizer, held_out, pad)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    report = {"recipe": recipe, "policy_sha256": file_sha256(policy_dir / WEIGHTS),
              "built_with": f"torch {torch.__version__}, {tinymodel._cpu_model()}",
              "held_out_accuracy": held, "held_out_accuracy_before": start_accuracy,
              "held_out_right_share": sum(y for _, y in held_out) / len(held_out),
              "held_out_texts": len(held_out), "steps": steps, "seconds": round(time.time() - t0, 1)}
    logger.info("tiny reward model: held-out accuracy %.3f (%.3f untrained), %d steps, %s s -> %s",
                held, start_accuracy, steps, report["seconds"], out)
    return report


def ensure_tiny_reward_model(root: str | os.PathLike | None = None, recipe: dict | None = None,
                             progress: bool = True, rebuild: bool = False) -> Path:
    """The folder of the tiny reward model: the shipped weights for the default recipe
    (checked against their SHA-256), else trained once and cached. ``rebuild`` trains
    even when shipped weights exist."""
    recipe = {**DEFAULT_RECIPE, **(recipe or {})}
    out = Path(root or default_cache()) / f"tiny-rm-{recipe_id(recipe)}"
    shipped = shipped_manifest(SHIPPED_DIR)
    if not rebuild and cache_is_good(out, recipe, shipped):
        return out

    def build(staging: Path) -> None:
        if not rebuild and shipped and shipped.get("recipe") == recipe:
            shutil.copytree(SHIPPED_DIR, staging)
            verify_model_folder(staging)
            logger.info("tiny reward model: shipped weights %s... -> %s", shipped["sha256"][:12], out)
            return
        report = train(recipe, staging, progress)
        report["sha256"] = file_sha256(staging / WEIGHTS)
        report["source"] = "rebuilt" if shipped and shipped.get("recipe") == recipe else "trained"
        (staging / MANIFEST).write_text(json.dumps(report, indent=2))

    return install_folder(out, build, lambda: not rebuild and cache_is_good(out, recipe, shipped))


def ship(folder: Path) -> None:
    """Copy a built reward model into workers/assets/tiny-rm (what the project ships)."""
    if not (folder / MANIFEST).exists():
        raise RewardModelBuildError(f"{folder} has no {MANIFEST}: not a built reward model")
    shutil.rmtree(SHIPPED_DIR, ignore_errors=True)
    shutil.copytree(folder, SHIPPED_DIR, ignore=shutil.ignore_patterns("*.lock"))
