"""Can RL raise held-out greedy accuracy on this model? Two probes that need no vLLM or
DeepSpeed, so they separate "the regime" from "the engine":

    # which held-out prompts RL could flip: greedy right/wrong × how often sampling is right
    .venv/bin/python bench/rl_regime.py frontier --dataset "gen:add?max_digits=2"
    # a plain PyTorch GRPO loop (HF sampling, Adam, group advantages, token-mean loss)
    .venv/bin/python bench/rl_regime.py grpo --dataset "gen:chain?max_value=10&max_terms=12" \
        --lr 1e-4 --temperature 0.5 --steps 400

RL only reinforces answers it samples. A prompt answered wrongly by greedy decoding can
only be flipped if sampling sometimes gets it right; ``frontier`` counts those prompts.
``grpo`` prints sampled reward and held-out greedy accuracy as it trains; the engine
(``python -m workers run``) reproduces its curves (docs/results.md). Its step,
``grpo_step``, is also the plain baseline of bench/vs_plain.py.
"""
from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from workers.models import tinymodel  # noqa: E402
from workers.tasks import builtin_rewards as rewards, datasets as tasks  # noqa: E402
from workers.models.tinymodel import complete, greedy_accuracy  # noqa: E402
from workers.train.algorithms import group_advantages  # noqa: E402

PAD = tinymodel.PAD_ID


def score(rows: list[dict], comps: list[list[int]], n: int, reward=rewards.numeric_match) -> list[float]:
    return [reward(rows[i // n]["prompt"], tinymodel.decode(c), rows[i // n]["answer"]) for i, c in enumerate(comps)]


def frontier(model, held: list[dict], args) -> None:
    model.eval()
    greedy = score(held, complete(model, [r["prompt"] for r in held], args.max_new), 1)
    sampled = score(held, complete(model, [r["prompt"] for r in held], args.max_new, args.temperature, args.samples),
                    args.samples)
    cells = collections.Counter()
    for i in range(len(held)):
        p = sum(sampled[i * args.samples:(i + 1) * args.samples]) / args.samples
        cells[("right" if greedy[i] else "wrong", round(p * 4) / 4)] += 1
    print(f"greedy {sum(greedy) / len(held):.3f}, sampled at T={args.temperature} "
          f"{sum(sampled) / len(sampled):.3f} ({len(held)} held-out prompts × {args.samples})")
    print("greedy | share of samples right (nearest quarter) | prompts")
    for key in sorted(cells):
        print(f"{key[0]:>6} | {key[1]:.2f} | {cells[key]}")
    flippable = sum(v for (g, p), v in cells.items() if g == "wrong" and p >= 0.25)
    print(f"RL could flip {flippable} wrong prompts (sampled right ≥ 1/8 of the time, row ≥ 0.25); "
          f"{cells[('wrong', 0.0)]} are out of reach")


def grpo_optimizer(model, lr: float, warmup_steps: int = 10):
    """Adam with a linear warm-up (as the engine's ``algorithm.warmup_steps``): Adam's first
    steps are sign-like and would move every weight by the full lr."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup_steps))


def grpo_step(model, opt, sched, rows: list[dict], n: int, max_new: int, temperature: float,
              reward=rewards.numeric_match) -> list[float]:
    """One GRPO step on ``rows`` (``n`` samples each): sample, score, group advantages,
    token-mean policy-gradient loss, one Adam step. Returns the sampled rewards."""
    model.eval()
    comps = complete(model, [r["prompt"] for r in rows], max_new, temperature, n)
    model.train()
    rew = score(rows, comps, n, reward)
    adv = torch.tensor(group_advantages(rew, n))
    seqs = [tinymodel.encode(rows[i // n]["prompt"]) + c for i, c in enumerate(comps)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), PAD)
    att = torch.zeros_like(ids)
    mask = torch.zeros((len(seqs), width - 1))
    for i, s in enumerate(seqs):
        p = len(seqs[i]) - len(comps[i])
        ids[i, :len(s)] = torch.tensor(s)
        att[i, :len(s)] = 1
        mask[i, p - 1:len(s) - 1] = 1  # position t predicts token t+1
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1] / temperature
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    loss = -(adv[:, None] * logp * mask).sum() / mask.sum().clamp(min=1)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return rew


def grpo(model, train: list[dict], held: list[dict], args) -> None:
    opt, sched = grpo_optimizer(model, args.lr)
    reward = rewards.BUILTIN_REWARDS[args.reward]
    t0, recent = time.time(), []
    print(f"step 0 greedy {greedy_accuracy(model, held, args.max_new):.3f}", flush=True)
    for step in range(1, args.steps + 1):
        rew = grpo_step(model, opt, sched, random.sample(train, args.prompts), args.group, args.max_new,
                        args.temperature, reward)
        recent.append(sum(rew) / len(rew))
        if step % args.eval_every == 0:
            print(f"step {step} sampled reward {sum(recent) / len(recent):.3f} "
                  f"greedy {greedy_accuracy(model, held, args.max_new):.3f} ({time.time() - t0:.0f} s)", flush=True)
            recent = []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probe", choices=["frontier", "grpo"])
    ap.add_argument("--model", help="HF folder (default: the tiny model, built if needed)")
    ap.add_argument("--dataset", default="gen:chain?max_value=10&max_terms=12")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--samples", type=int, default=16, help="frontier: samples per held-out prompt")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--prompts", type=int, default=16, help="grpo: prompts per step")
    ap.add_argument("--group", type=int, default=8, help="grpo: samples per prompt")
    ap.add_argument("--reward", default="numeric_match", choices=sorted(rewards.BUILTIN_REWARDS))
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model or tinymodel.ensure_tiny_model(), dtype=torch.float32)
    train, held = tasks.load_rows(args.dataset, size=4000, eval_size=200, seed=0)
    if args.probe == "frontier":
        frontier(model, held, args)
    else:
        grpo(model, train, held, args)


if __name__ == "__main__":
    main()
