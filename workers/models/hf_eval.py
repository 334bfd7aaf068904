"""Held-out accuracy measured without the engine: plain Hugging Face greedy generation
of a model folder, with its own tokenizer, prompt format and stop ids, scored by a
built-in reward. It checks what a run reports (``eval/accuracy``) from outside:

    python -m workers evaluate RUN_DIR/final_model spec.yaml [--prompts N]
"""
from __future__ import annotations

import logging

import torch

from workers.models.preflight import check_run
from workers.tasks.model_folder import check_model_folder
from workers.tasks.prompts import stop_token_ids

logger = logging.getLogger(__name__)


def greedy_texts(folder: str, renderer, rows: list[dict], max_new: int, batch: int = 32) -> list[str]:
    """Greedy completions (decoded, special tokens left out) of ``rows`` by the model in ``folder``."""
    from transformers import AutoModelForCausalLM

    tokenizer = renderer.tokenizer
    stops = stop_token_ids(folder, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else 0)
    model = AutoModelForCausalLM.from_pretrained(check_model_folder(folder), dtype=torch.float32).eval()
    texts: list[str] = []
    for i in range(0, len(rows), batch):
        enc = [renderer.ids(r) for r in rows[i:i + batch]]
        width = max(map(len, enc))
        ids = torch.full((len(enc), width), pad)
        att = torch.zeros((len(enc), width), dtype=torch.long)
        for k, e in enumerate(enc):  # left-padded: every prompt ends where generation starts
            ids[k, width - len(e):] = torch.tensor(e)
            att[k, width - len(e):] = 1
        with torch.no_grad():
            out = model.generate(ids, attention_mask=att, max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=stops or None, pad_token_id=pad)
        for row in out[:, width:].tolist():
            cut = next((j for j, t in enumerate(row) if t in stops), None)
            texts.append(renderer.decode(row if cut is None else row[: cut + 1]))
    return texts


def greedy_accuracy(folder: str, spec, rows: list[dict]) -> float:
    """Mean reward of greedy completions, scored by the spec's reward as the engine's
    ``eval/accuracy`` is (user code in its sandbox); rows too long for the spec's
    ``max_model_len`` are left out, as the engine leaves them out."""
    from workers.rewards.service import RewardService

    spec = spec.model_copy(deep=True)
    spec.model.path = folder  # the folder's own copy of the tokenizer and chat template
    checked = check_run(spec, rows, [], check_architecture=False)
    rows = checked.train_rows
    texts = greedy_texts(folder, checked.renderer, rows, spec.rollout.max_tokens)
    rewards = RewardService(spec.reward)
    try:
        scores = [rewards.score_sync(r["prompt"], t, {k: v for k, v in r.items() if k != "prompt"})
                  for r, t in zip(rows, texts)]
    finally:
        rewards.close()
    return sum(s.reward for s in scores) / max(1, len(scores))


def evaluate_folder(folder: str, spec, prompts: int | None = None) -> dict:
    """``python -m workers evaluate``: the spec's held-out rows (as a run draws them)."""
    from workers.tasks.datasets import load_rows

    t = spec.task
    _, held_out = load_rows(t.dataset, t.size, t.eval_size, t.seed, t.prompt_field, t.answer_field)
    rows = held_out[: spec.eval.prompts if prompts is None else prompts]
    if not rows:
        raise ValueError("the spec has no held-out rows (task.eval_size / eval.prompts)")
    return {"model": folder, "prompts": len(rows), "accuracy": greedy_accuracy(folder, spec, rows)}
