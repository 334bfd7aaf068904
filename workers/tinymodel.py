"""Builds the tiny model FluxRL trains on a CPU: a character-level tokenizer and a small
Qwen2 causal LM, warm-started by a short supervised run on synthetic tasks so that RL
starts from a policy that is right some of the time. Saved as a plain HF folder that
vLLM and DeepSpeed load like any other model. Deterministic in its seed and cached.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import random
import string
import time
from pathlib import Path

import torch

from . import tasks

CHARS = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]  # 95 printable ASCII
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)

DEFAULT_RECIPE = {
    "seed": 0,
    "hidden": 128,
    "layers": 3,
    "heads": 2,
    # The SFT is planned for `schedule_steps` (data and cosine schedule) and stopped
    # after `steps`, at 66% of its peak rate, while it is still learning 2-digit carries.
    # That leaves RL a frontier: prompts the model answers right only some of the time.
    # Run to the end of a short schedule, the model was a lookup table of 1-digit sums
    # (every prompt with a 2-digit operand P(correct) < 0.05) and no RL could move it;
    # annealed to lr 0, it was knocked down by any update (README, "What RL does").
    "steps": 1200,
    "schedule_steps": 3000,
    "batch": 64,
    "lr": 5e-3,
    "final_lr_ratio": 0.1,  # cosine floor, as a share of the peak rate
    # Mix of short (add) and long-tailed (chain) answers.
    "mix": {"add": 0.5, "chain": 0.5},
    "params": {"add": {"max_digits": 2}, "chain": {"max_value": 10, "max_terms": 12}},
}


def recipe_id(recipe: dict) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def encode(text: str) -> list[int]:
    """Token ids without the tokenizer object: one id per character (hot path)."""
    return [_CHAR_ID.get(c, UNK_ID) for c in text]


def decode(ids) -> str:
    return "".join(_ID_CHAR.get(i, "") for i in ids)


_CHAR_ID = {c: i + len(SPECIALS) for i, c in enumerate(CHARS)}
_ID_CHAR = {i: c for c, i in _CHAR_ID.items()}


def build_model(recipe: dict):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=128,  # 99 used; a round size the kernels like
        hidden_size=recipe["hidden"],
        intermediate_size=recipe["hidden"] * 3,
        num_hidden_layers=recipe["layers"],
        num_attention_heads=recipe["heads"],
        num_key_value_heads=recipe["heads"],
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )
    torch.manual_seed(recipe["seed"])
    return Qwen2ForCausalLM(cfg)


def training_rows(recipe: dict, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for k, (name, share) in enumerate(sorted(recipe["mix"].items())):
        rows += tasks.generate(name, int(n * share), seed=seed * 1000 + k, **recipe.get("params", {}).get(name, {}))
    rng.shuffle(rows)
    return rows


def _batch(rows: list[dict]):
    seqs, masks = [], []
    for r in rows:
        p, a = encode(r["prompt"]), encode(r["answer"]) + [EOS_ID]
        seqs.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), PAD_ID)
    lab = torch.full((len(seqs), width), -100)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
        lab[i, : len(s)] = torch.tensor([t if k else -100 for t, k in zip(s, m)])
    return ids, att, lab


@torch.no_grad()
def complete(model, prompts: list[str], max_new: int, temperature: float = 0.0, n: int = 1) -> list[list[int]]:
    """Completions with plain HF generation, no vLLM (greedy when ``temperature`` is 0):
    token ids up to and including EOS; prompt i owns rows i*n .. i*n+n-1. Prompts are
    left-padded into one batch."""
    enc = [encode(p) for p in prompts]
    width = max(map(len, enc))
    ids = torch.full((len(enc), width), PAD_ID)
    att = torch.zeros((len(enc), width), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, width - len(e):] = torch.tensor(e)
        att[i, width - len(e):] = 1
    how = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    out = model.generate(ids, attention_mask=att, max_new_tokens=max_new, num_return_sequences=n,
                         eos_token_id=EOS_ID, pad_token_id=PAD_ID, **how)
    rows = out[:, width:].tolist()
    return [row[: row.index(EOS_ID) + 1] if EOS_ID in row else row for row in rows]


def greedy_accuracy(model, rows: list[dict], max_new: int = 48, batch: int = 100) -> float:
    """Held-out exact-answer accuracy (numeric_match) under greedy decoding, no vLLM."""
    from .rewards import numeric_match

    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        for r, toks in zip(chunk, complete(model, [r["prompt"] for r in chunk], max_new)):
            correct += numeric_match(r["prompt"], decode(toks), r["answer"])
    model.train(was_training)
    return correct / max(1, len(rows))


def default_cache() -> Path:
    return Path(os.environ.get("FLUXRL_MODEL_CACHE", Path.home() / ".cache" / "fluxrl" / "models"))


def ensure_tiny_model(root: str | os.PathLike | None = None, recipe: dict | None = None, progress: bool = True) -> Path:
    """Return the folder of the tiny model for ``recipe``, building it once if needed."""
    recipe = {**DEFAULT_RECIPE, **(recipe or {})}
    out = Path(root or default_cache()) / f"tiny-{recipe_id(recipe)}"
    done = out / "fluxrl_bootstrap.json"
    if done.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(str(out) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others reuse its result
        if done.exists():
            return out
        report = _train(recipe, out, progress)
        done.write_text(json.dumps(report, indent=2))
    return out


def planned_steps(recipe: dict) -> int:
    """The SFT's planned length (its data and schedule); ``steps`` of them are run."""
    return recipe.get("schedule_steps", recipe["steps"])


def sft_lr_factor(step: int, recipe: dict) -> float:
    """Share of the peak SFT rate at ``step``: linear warm-up over the first 5% of the
    planned steps, then a cosine over the planned steps, never below ``final_lr_ratio``."""
    planned = planned_steps(recipe)
    warm = max(1, planned // 20)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, step / planned)))
    return min(1.0, (step + 1) / warm) * max(recipe.get("final_lr_ratio", 0.0), cosine)


def _train(recipe: dict, out: Path, progress: bool) -> dict:
    from tqdm import tqdm

    # One thread: bit-for-bit reproducible, and it never oversubscribes a busy machine.
    torch.set_num_threads(1)
    torch.manual_seed(recipe["seed"])
    model = build_model(recipe)
    rows = training_rows(recipe, planned_steps(recipe) * recipe["batch"], seed=recipe["seed"] + 1)
    held_out = training_rows(recipe, 100, seed=recipe["seed"] + 99)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=0.01)
    steps = recipe["steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: sft_lr_factor(s, recipe))
    t0 = time.time()
    bar = tqdm(range(steps), desc="warm start (SFT)", disable=not progress, unit="step")
    for step in bar:
        ids, att, lab = _batch(rows[step * recipe["batch"] : (step + 1) * recipe["batch"]])
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    accuracy = greedy_accuracy(model, held_out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    report = {"recipe": recipe, "final_loss": float(loss.detach()), "held_out_accuracy": accuracy,
              "params": sum(p.numel() for p in model.parameters()), "seconds": round(time.time() - t0, 1)}
    if progress:
        print(f"tiny model: {report['params']:,} params, held-out accuracy {accuracy:.1%}, {report['seconds']} s -> {out}")
    return report
