"""Small models of real architectures, with real trained tokenizers and chat templates,
built on this machine: proof that FluxRL trains any Hugging Face causal LM, not only its
character-level tiny model.

Three architectures vLLM and transformers both support:

- ``qwen2``: Qwen2ForCausalLM (RoPE, GQA), a byte-level BPE tokenizer (~2048 pieces,
  digits split one by one as in Qwen2 and Llama 3), the ChatML format
  (``<|im_start|>role\\n...<|im_end|>\\n``);
- ``llama``: LlamaForCausalLM (untied head), a SentencePiece-style Unigram tokenizer
  (~1024 pieces, Metaspace, byte fallback, BOS added by a post-processor) and a
  Llama-3-like format (``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``);
- ``gpt2``: GPT2LMHeadModel (learned absolute positions, Conv1D weights), the BPE
  tokenizer and a Phi-3-like format (``<|user|>\\n...<|end|>\\n``).

Each tokenizer is trained with the ``tokenizers`` library on a synthetic corpus made
here (arithmetic chat exchanges plus English-like sentences, deterministic in the
seed), saved as a ``PreTrainedTokenizerFast`` with its ``chat_template``; each
``generation_config.json`` lists an end-of-turn and an end-of-text id, as real chat
models do. The model is warm-started by a short SFT on chat-formatted 2-digit additions
(loss on the assistant's tokens and its end-of-turn token), stopped while it is still
learning (once greedy accuracy on dev prompts reaches 0.35): held-out greedy accuracy is
left in the middle, so that RL has room to raise it. Single-threaded and deterministic
on a given CPU; vLLM's greedy output on the CPU matches transformers' token for token.

    build_zoo_model("qwen2", "out/qwen2")   # a complete HF folder
    ensure_zoo_model("llama")                # built once, cached under $FLUXRL_MODEL_CACHE
    python -m workers build-model gpt2 [--out DIR] [--steps N]
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

from workers.models.tinymodel import (WEIGHTS, _cpu_model, default_cache, file_sha256, install_folder, recipe_id,
                                      sft_lr_factor, supervised_steps, verify_model_folder)
from workers.models.zoo_data import FORMATS, arith_rows, assistant_reply, held_out_key
from workers.models.zoo_tokenizers import build_tokenizer, padded_vocab, save_tokenizer, stop_ids

logger = logging.getLogger(__name__)

ARCHS = ("qwen2", "llama", "gpt2")
MANIFEST = "fluxrl_zoo.json"  # recipe, held-out accuracy, checksum
ASSETS = Path(__file__).resolve().parents[1] / "assets"

_COMMON = {
    "seed": 0,
    "hidden": 128,
    "heads": 2,
    "head_dim": 64,  # a size vLLM's CPU attention has kernels for
    "max_positions": 512,
    # The SFT is planned over `schedule_steps` (data and cosine schedule, as the tiny
    # model's) and stopped while held-out accuracy is still climbing steeply, on 2-digit
    # sums most of all: when greedy accuracy on `dev` other prompts reaches
    # `stop_at_accuracy` (checked every `check_every` steps), after `steps` at most.
    # At a peak rate of 3e-3 the SFT was unstable (with some data orders the model was
    # still failing to copy the operands after 1600 steps); at 1.5e-3 to 2e-3 it learned
    # the same way across seeds.
    "batch": 16,
    "final_lr_ratio": 0.1,
    "betas": [0.9, 0.95],
    "stop_at_accuracy": 0.35,
    "dev": 100,
    "check_from": 250,
    "check_every": 25,
    "corpus": {"chat": 6000, "prose": 14000},
    "system_share": 0.3,
    "held_out": 400,
}
RECIPES: dict[str, dict] = {
    "qwen2": {**_COMMON, "arch": "qwen2", "tokenizer": "bpe", "vocab": 2048, "layers": 3, "kv_heads": 1,
              "tie": True, "lr": 1.5e-3, "steps": 1500, "schedule_steps": 2000},
    # Two layers: its prompts are a third longer (Llama 3's headers, a smaller vocabulary),
    # and with two it learned faster per step than with three.
    "llama": {**_COMMON, "arch": "llama", "tokenizer": "unigram", "vocab": 1024, "layers": 2, "kv_heads": 2,
              "tie": False, "lr": 1.5e-3, "steps": 1500, "schedule_steps": 2000},
    # Learned absolute positions: slower to find the operands than RoPE, and no slower
    # with two layers than with three.
    "gpt2": {**_COMMON, "arch": "gpt2", "tokenizer": "bpe", "vocab": 2048, "layers": 2,
             "tie": True, "lr": 2e-3, "steps": 1500, "schedule_steps": 2000},
}


def zoo_recipe(arch: str, steps: int | None = None, seed: int = 0) -> dict:
    """The recipe of ``arch``; ``steps`` runs exactly that many SFT steps (no stop on accuracy)."""
    if arch not in RECIPES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    recipe = {**RECIPES[arch], "seed": seed}
    if steps is not None:
        recipe.update(steps=int(steps), stop_at_accuracy=None)
    return recipe


# --- models ---------------------------------------------------------------------------

def build_model(recipe: dict, tokenizer):
    """The untrained model: float32, ``vocab_size`` = len(tokenizer) rounded up to 64."""
    import transformers

    arch, fmt = recipe["arch"], FORMATS[recipe["arch"]]
    ids = {k: tokenizer.convert_tokens_to_ids(t) if t else None
           for k, t in (("bos", fmt.bos or fmt.pad), ("eos", fmt.end_of_turn), ("pad", fmt.pad))}
    common = dict(vocab_size=padded_vocab(tokenizer), tie_word_embeddings=recipe["tie"], bos_token_id=ids["bos"],
                  eos_token_id=ids["eos"], pad_token_id=ids["pad"], dtype="float32")
    h, heads, hd = recipe["hidden"], recipe["heads"], recipe["head_dim"]
    if arch == "qwen2":
        if heads * hd != h:  # vLLM's Qwen2 takes the head size to be hidden / heads
            raise ValueError(f"qwen2 needs heads * head_dim == hidden, not {heads} * {hd} != {h}")
        cfg = transformers.Qwen2Config(hidden_size=h, intermediate_size=3 * h, num_hidden_layers=recipe["layers"],
                                       num_attention_heads=heads, num_key_value_heads=recipe["kv_heads"],
                                       head_dim=hd, max_position_embeddings=recipe["max_positions"], **common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "llama":
        cfg = transformers.LlamaConfig(hidden_size=h, intermediate_size=3 * h, num_hidden_layers=recipe["layers"],
                                       num_attention_heads=heads, num_key_value_heads=recipe["kv_heads"],
                                       head_dim=hd, max_position_embeddings=recipe["max_positions"],
                                       rms_norm_eps=1e-5, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=h, n_inner=4 * h, n_layer=recipe["layers"], n_head=heads,
                                      n_positions=recipe["max_positions"], resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, **common)  # no dropout, as the others
        cls = transformers.GPT2LMHeadModel
    else:
        raise ValueError(f"unknown architecture {arch!r}")
    torch.manual_seed(recipe["seed"])
    return cls(cfg)


def generation_config(tokenizer, arch: str):
    from transformers import GenerationConfig

    fmt = FORMATS[arch]
    return GenerationConfig(bos_token_id=tokenizer.convert_tokens_to_ids(fmt.bos or fmt.pad),
                            eos_token_id=stop_ids(tokenizer, arch),
                            pad_token_id=tokenizer.convert_tokens_to_ids(fmt.pad))


# --- warm start -----------------------------------------------------------------------

def prompt_texts(tokenizer, rows: list[dict]) -> list[str]:
    return [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in rows]


def sft_examples(tokenizer, rows: list[dict], arch: str) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per row: the chat prompt, then the assistant's reply
    and its end-of-turn token, encoded as one text (as the tokenizer splits the whole
    conversation) and encoded without the tokenizer's own BOS, since the template writes it."""
    prompts = prompt_texts(tokenizer, rows)
    end = FORMATS[arch].end_of_turn
    enc = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    full = tokenizer([p + assistant_reply(r) + end for p, r in zip(prompts, rows)],
                     add_special_tokens=False)["input_ids"]
    out = []
    for p, f in zip(enc, full):
        if f[: len(p)] != p:
            raise RuntimeError(f"the prompt's tokens are not a prefix of the conversation's: {p} vs {f}")
        out.append((f, len(p)))
    return out


def _batch(examples: list[tuple[list[int], int]], pad_id: int):
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id)
    att = torch.zeros((len(examples), width), dtype=torch.long)
    lab = torch.full((len(examples), width), -100)
    for i, (seq, plen) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        att[i, : len(seq)] = 1
        lab[i, plen: len(seq)] = torch.tensor(seq[plen:])
    return ids, att, lab


def sft_loss(model, ids, att, lab):
    """Mean cross-entropy of the labelled tokens, the output head applied only where a
    label follows (the reply's ~10 positions, not the prompt's ~25): the same loss as
    ``model(..., labels=lab).loss``, for a third of the head's work."""
    hidden = model.base_model(input_ids=ids, attention_mask=att).last_hidden_state
    target = lab[:, 1:]
    keep = target != -100
    logits = model.get_output_embeddings()(hidden[:, :-1][keep])
    return torch.nn.functional.cross_entropy(logits.float(), target[keep])


@torch.no_grad()
def greedy_completions(model, prompts: list[list[int]], stop: list[int], pad_id: int, max_new: int = 16,
                       batch: int = 64) -> list[list[int]]:
    """HF greedy completions (ids up to and including the first stop id). Prompts are
    batched by length, so that no prompt is padded: each is decoded as it would be alone."""
    out: list[list[int] | None] = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    was_training = model.training
    model.eval()
    for idx in by_len.values():
        for k in range(0, len(idx), batch):
            chunk = idx[k:k + batch]
            ids = torch.tensor([prompts[i] for i in chunk])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=stop, pad_token_id=pad_id)
            for i, row in zip(chunk, gen[:, ids.shape[1]:].tolist()):
                cut = next((j for j, t in enumerate(row) if t in stop), None)
                out[i] = row if cut is None else row[: cut + 1]
    model.train(was_training)
    return out


def held_out_rows(recipe: dict) -> list[dict]:
    """The warm start's held-out prompts: never trained on (their operand pairs are left out)."""
    return arith_rows(recipe["held_out"], random.Random(recipe["seed"] * 1000 + 99), recipe["system_share"])


def greedy_accuracy(model, tokenizer, rows: list[dict], arch: str, max_new: int = 16) -> float:
    """Held-out greedy accuracy: the last number of the completion equals the sum."""
    from workers.tasks.builtin_rewards import numeric_match

    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in prompt_texts(tokenizer, rows)]
    comps = greedy_completions(model, prompts, stop_ids(tokenizer, arch), tokenizer.pad_token_id, max_new)
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in comps]
    return sum(numeric_match("", t, r["answer"]) for t, r in zip(texts, rows)) / max(1, len(rows))


def dev_rows(recipe: dict) -> list[dict]:
    """The prompts the warm start watches to know when to stop (apart from the held-out
    ones, which only measure the result)."""
    return arith_rows(recipe["dev"], random.Random(recipe["seed"] * 1000 + 98), recipe["system_share"])


def sft_loop(model, tokenizer, examples: list, recipe: dict, desc: str, dev_accuracy_of, progress: bool,
             batch_of=None):
    """A warm start's supervised steps over ``examples`` (padded into tensors by ``batch_of``,
    this module's prompt-length batches by default) at the recipe's batch, lr schedule and
    clipping, stopping early once ``dev_accuracy_of()`` (checked every ``check_every`` steps from
    ``check_from``) reaches ``stop_at_accuracy``. Returns (steps done, last loss, last dev
    accuracy or None, seconds)."""
    steps, batch, target = recipe["steps"], recipe["batch"], recipe.get("stop_at_accuracy")
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], betas=tuple(recipe["betas"]), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: sft_lr_factor(s, recipe))
    batch_of = batch_of or _batch
    dev_accuracy = None

    def batch_loss(step: int):
        return sft_loss(model, *batch_of(examples[step * batch:(step + 1) * batch], tokenizer.pad_token_id))

    def reached(done: int) -> bool:
        nonlocal dev_accuracy
        if target is None or done < recipe["check_from"] or done % recipe["check_every"]:
            return False
        dev_accuracy = dev_accuracy_of()
        model.train()
        return dev_accuracy >= target

    model.train()
    t0 = time.time()
    done, loss = supervised_steps(model, opt, sched, steps, batch_loss, desc=desc, progress=progress, stop=reached,
                                  postfix=lambda: {"dev": f"{dev_accuracy:.2f}"} if dev_accuracy is not None else {})
    return done, loss, dev_accuracy, time.time() - t0


def _sft(model, tokenizer, recipe: dict, progress: bool) -> dict:
    """At most ``steps`` steps; with ``stop_at_accuracy``, stopped at the first check (every
    ``check_every`` steps from ``check_from``) where greedy accuracy on the dev prompts
    reaches it. The accuracy climbs steeply once the model has learned where the
    operands are, and when that happens moves with anything that changes the run (the
    tokenizer's ids, the CPU's rounding): a fixed step count would land anywhere
    between 0.15 and 0.65, a stop on accuracy lands in the middle."""
    arch = recipe["arch"]
    held_out, dev = held_out_rows(recipe), dev_rows(recipe)
    exclude = frozenset(held_out_key(r) for r in held_out + dev)
    rows = arith_rows(recipe["steps"] * recipe["batch"], random.Random(recipe["seed"] * 1000 + 1), recipe["system_share"], exclude)
    examples = sft_examples(tokenizer, rows, arch)
    done, loss, dev_accuracy, seconds = sft_loop(model, tokenizer, examples, recipe, f"{arch} warm start (SFT)",
                                                 lambda: greedy_accuracy(model, tokenizer, dev, arch), progress)
    accuracy = greedy_accuracy(model, tokenizer, held_out, arch)
    return {"sft_steps": done, "final_loss": round(float(loss.detach()), 4), "sft_seconds": round(seconds, 1),
            "dev_accuracy": dev_accuracy, "held_out_accuracy": accuracy, "held_out_size": len(held_out)}


def build_zoo_model(arch: str, out_dir, *, steps: int | None = None, seed: int = 0, progress: bool = False) -> Path:
    """Train the tokenizer, build and warm-start the model of ``arch`` (one of ARCHS) and
    write a complete HF folder to ``out_dir`` (config, generation config, weights,
    tokenizer with its chat template, and ``fluxrl_zoo.json``: recipe, held-out
    accuracy, weights checksum). ``steps`` overrides the recipe's SFT steps (the
    schedule stays the one planned). Single-threaded and deterministic in ``seed``."""
    recipe = zoo_recipe(arch, steps, seed)
    out, manifest = build_folder(recipe, out_dir, arch, build_tokenizer, _sft, progress)
    logger.info("%s: %s params, vocab %d, %d SFT steps in %.1f s, held-out greedy accuracy %.1f%% -> %s", arch,
                f"{manifest['params']:,}", manifest["len_tokenizer"], manifest["sft_steps"], manifest["sft_seconds"],
                100 * manifest["held_out_accuracy"], out)
    return out


def build_folder(recipe: dict, out_dir, arch: str, tokenizer_of, sft, progress: bool, **named) -> tuple[Path, dict]:
    """A zoo model's folder: the tokenizer ``tokenizer_of(recipe)`` trained, the model built and
    warm-started by ``sft(model, tokenizer, recipe, progress)`` (its report goes into the
    manifest), then config, generation config, weights, tokenizer and ``fluxrl_zoo.json``
    (``named`` first, then the recipe, the report and the weights' checksum) written to
    ``out_dir``. Single-threaded: bit-for-bit reproducible, and it never oversubscribes a busy
    machine. Returns (the folder, its manifest)."""
    out = Path(out_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.time()
        tokenizer = tokenizer_of(recipe)
        tokenizer_s = time.time() - t0
        model = build_model(recipe, tokenizer)
        report = sft(model, tokenizer, recipe, progress)
        out.mkdir(parents=True, exist_ok=True)
        model.generation_config = generation_config(tokenizer, arch)
        model.save_pretrained(out, safe_serialization=True)
        save_tokenizer(tokenizer, out)
    finally:
        torch.set_num_threads(threads)
    manifest = {
        "arch": arch, **named, "architecture": type(model).__name__, "recipe": recipe, **report,
        "tokenizer_seconds": round(tokenizer_s, 1), "len_tokenizer": len(tokenizer),
        "vocab_size": model.config.vocab_size, "eos_token_id": stop_ids(tokenizer, arch),
        "params": sum(p.numel() for p in model.parameters()),
        "built_with": f"torch {torch.__version__}, {_cpu_model()}", "sha256": file_sha256(out / WEIGHTS),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out, manifest


def cache_is_good(out: Path, recipe: dict) -> bool:
    """Whether a cached zoo folder holds a model of ``recipe`` whose files match its manifest."""
    if not (out / MANIFEST).exists():
        return False
    try:
        manifest = verify_model_folder(out, MANIFEST)
    except (RuntimeError, ValueError, OSError) as exc:
        logger.warning("zoo model cache %s is damaged (%s): rebuilding it", out, exc)
        return False
    return manifest.get("recipe") == recipe


def shipped_model(name: str, recipe: dict) -> Path | None:
    """The warm start ``name`` shipped with the project (``workers/assets/zoo-<name>``, about
    3 MB each), if it was built from ``recipe``. Shipped for the tiny model's reason: the
    same recipe trained on another CPU is another model (its starting accuracy moves by
    several points), and building them takes minutes of every fresh install's tests."""
    folder = ASSETS / f"zoo-{name}"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return folder if manifest.get("recipe") == recipe else None


def shipped_zoo_model(arch: str, recipe: dict) -> Path | None:
    return shipped_model(arch, recipe)


def ensure_built(name: str, recipe: dict, root: str | os.PathLike | None, build_here) -> Path:
    """The folder ``zoo-<name>-<recipe id>`` under ``$FLUXRL_MODEL_CACHE`` (or ``root``): the
    shipped warm start for ``recipe`` (checked against its SHA-256), else ``build_here(staging)``
    once; concurrent callers wait for one builder, and a damaged cache is replaced."""
    out = Path(root or default_cache()) / f"zoo-{name}-{recipe_id(recipe)}"
    if cache_is_good(out, recipe):
        return out
    shipped = shipped_model(name, recipe)

    def build(staging: Path) -> None:
        if shipped is not None:
            shutil.copytree(shipped, staging)
            verify_model_folder(staging, MANIFEST)  # a damaged copy is refused, never installed
            logger.info("%s: shipped warm start -> %s", name, out)
        else:
            build_here(staging)

    return install_folder(out, build, lambda: cache_is_good(out, recipe))


def ensure_zoo_model(arch: str, root: str | os.PathLike | None = None, *, steps: int | None = None, seed: int = 0,
                     progress: bool = False) -> Path:
    """The folder of the zoo model ``arch`` under ``$FLUXRL_MODEL_CACHE`` (or ``root``) as
    ``zoo-<arch>-<recipe id>`` (``ensure_built``)."""
    return ensure_built(arch, zoo_recipe(arch, steps, seed), root,
                        lambda staging: build_zoo_model(arch, staging, steps=steps, seed=seed, progress=progress))
