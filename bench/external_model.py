"""A model folder built apart from FluxRL's zoo: what a user brings to a run.

A user found the default spec learning worse than ``algorithm.minibatches: 1`` on "a Qwen2
folder with its own 64-id tokenizer", a model the zoo's code did not build. This script
builds such a folder with nothing from ``workers.models``, only transformers and tokenizers:

- a character-level tokenizer of 64 ids (a WordLevel vocabulary over the characters of the
  task, ChatML's two markers, a pad and an unknown id) with a ChatML chat template;
- a Qwen2ForCausalLM (3 layers, hidden 128, 2 heads of 64, 1 KV head, tied embeddings);
- a warm start by supervised fine-tuning on sums, answered with the number alone (the zoo's
  models answer with the whole equation), stopped when greedy accuracy on 100 dev prompts
  reaches ``--stop-at`` (0.4 by default: the issue's folder started RL at 0.42).

Only the task's prompts come from FluxRL (``write_chat_dataset``'s rows, at another seed), so
that the model is asked what ``bench/defaults.py`` will ask it.

    .venv/bin/python bench/external_model.py --out /tmp/external-qwen2 [--seed 0] [--stop-at 0.4]

(``bench/defaults.py --models external`` builds it once under the model cache.)
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

import torch

logger = logging.getLogger("external_model")

IM_START, IM_END, PAD, UNK = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<unk>"
# Every character the task's prompts and answers use, then spare letters up to 64 ids.
CHARACTERS = list("0123456789 \n+=?.,:") + list("abcdefghijklmnopqrstuvwxyz") + list("WYAHIT")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer():
    """A fast tokenizer that splits text into characters; 64 ids in all."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spare = [c for c in "BCDEFGJKLMNOPQRSUVXZ" if c not in CHARACTERS]
    chars = CHARACTERS + spare[:64 - 4 - len(CHARACTERS)]
    vocab = {tok: i for i, tok in enumerate([PAD, UNK, IM_START, IM_END] + chars)}
    if len(vocab) != 64:
        raise AssertionError(f"the tokenizer should have 64 ids, not {len(vocab)}")
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([PAD, UNK, IM_START, IM_END])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=PAD, unk_token=UNK,
                                  additional_special_tokens=[IM_START], model_max_length=512)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(tokenizer, seed: int):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384,
                                   num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=512, tie_word_embeddings=True,
                                   bos_token_id=tokenizer.convert_tokens_to_ids(IM_START),
                                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return transformers.Qwen2ForCausalLM(cfg)


def encode(tokenizer, row: dict) -> tuple[list[int], list[int]]:
    """The prompt's ids (through the chat template) and the answer's ids with the end marker."""
    text = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False), tokenizer.encode(row["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]


def greedy_accuracy(model, tokenizer, rows: list[dict], max_new: int = 6) -> float:
    model.eval()
    right = 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([encode(tokenizer, row)[0]])
            out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
            text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
            right += text == row["answer"]
    model.train()
    return right / len(rows)


def warm_start(model, tokenizer, rows: list[dict], dev: list[dict], stop_at: float, max_steps: int,
               batch: int = 16, lr: float = 1.5e-3) -> dict:
    """SFT on the answer's ids only, AdamW at ``lr`` with a linear decay over ``max_steps``;
    checks dev accuracy every 50 steps from step 200 and stops once it reaches ``stop_at``."""
    from tqdm import tqdm

    pad = tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.1, 1 - s / max_steps))
    model.train()
    accuracy, step, t0 = 0.0, 0, time.time()
    bar = tqdm(range(max_steps), desc="external qwen2 warm start", unit="step")
    for step in bar:
        pairs = [encode(tokenizer, r) for r in rows[step * batch % len(rows):][:batch]]
        width = max(len(p) + len(a) for p, a in pairs)
        ids = torch.full((len(pairs), width), pad)
        labels = torch.full((len(pairs), width), -100)
        mask = torch.zeros((len(pairs), width), dtype=torch.long)
        for i, (p, a) in enumerate(pairs):
            ids[i, :len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
            mask[i, :len(p) + len(a)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step >= 200 and step % 50 == 0:
            accuracy = greedy_accuracy(model, tokenizer, dev)
            bar.set_postfix(loss=f"{loss.item():.3f}", dev=f"{accuracy:.2f}")
            if accuracy >= stop_at:
                break
    bar.close()
    return {"sft_steps": step + 1, "dev_accuracy": accuracy, "sft_seconds": round(time.time() - t0, 1)}


def build_external_model(out: str | Path, seed: int = 0, stop_at: float = 0.4, max_steps: int = 4000) -> Path:
    """Build, warm-start and save the folder (config, generation config, weights, tokenizer)."""
    import transformers

    from workers.models.zoo_data import chat_arithmetic_rows  # the task's prompts, nothing of the models

    out = Path(out)
    torch.set_num_threads(2)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed)
    rows = chat_arithmetic_rows(max_steps * 16, seed=1000 + seed)
    dev = chat_arithmetic_rows(100, seed=2000 + seed, two_digit=True)
    info = warm_start(model, tokenizer, rows, dev, stop_at, max_steps)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = transformers.GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                                            pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "external_model.json").write_text(json.dumps({"seed": seed, "stop_at": stop_at, **info}, indent=2))
    logger.info("external Qwen2 in %s: %s", out, info)
    return out


def ensure_external_model(seed: int = 0) -> Path:
    """The folder under the model cache ($FLUXRL_MODEL_CACHE), built once (bench/defaults.py's
    ``--models external``)."""
    from workers.models.tinymodel import default_cache

    folder = default_cache() / f"external-qwen2-char64-s{seed}"
    if not (folder / "external_model.json").exists():
        build_external_model(folder, seed)
    return folder


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-at", type=float, default=0.4)
    ap.add_argument("--max-steps", type=int, default=4000)
    args = ap.parse_args()
    random.seed(args.seed)
    build_external_model(args.out, args.seed, args.stop_at, args.max_steps)


if __name__ == "__main__":
    main()
