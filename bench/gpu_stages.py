"""Do the inference stage's workers compute on a GPU what they compute on the CPU? The KL
reference's log-probs, the critic copy's values and the reward model's logits, each from
its scorer (the code its worker runs) on ``cuda`` and on the CPU, in fp32 so that the two
devices may differ only by kernel rounding; and the reference's log-probs in bf16 under
autocast (the trainer's GPU precision at ZeRO 0) within bf16's rounding.

    .venv/bin/python bench/gpu_stages.py              # exit 0 when every case is within its bound
    .venv/bin/python bench/gpu_stages.py --dry-run    # the CPU on both sides: checks the script itself

Without a GPU (and without --dry-run) it stops at once (exit 2).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from workers.models.tinymodel import ensure_tiny_model  # noqa: E402


def _items(n: int = 12) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(3, 14, (4 + i % 5,), generator=g).tolist(),
             torch.randint(3, 14, (3 + (i * 3) % 7,), generator=g).tolist()) for i in range(n)]


def _gap(a, b) -> float:
    return max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q))


def main() -> int:
    dry = "--dry-run" in sys.argv[1:]
    if not dry and not torch.cuda.is_available():
        print("gpu_stages: no CUDA GPU visible")
        return 2
    gpu_device = "cpu" if dry else "cuda"
    from safetensors.torch import save_file

    from workers.models.reward_model import ensure_tiny_reward_model
    from workers.train.reference import ReferenceScorer
    from workers.train.value_stage import ValueScorer
    from workers.rewards.model import Scorer

    path, items, failed = str(ensure_tiny_model(progress=False)), _items(), []
    common = {"path": path, "zero_stage": 0, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "pad_id": 0,
              "max_tokens": 64}  # several forwards per call: the split is exercised too
    cases = []
    for dtype, bound in (("float32", 1e-4), ("bfloat16", 0.1)):
        cpu = ReferenceScorer(**common, dtype=dtype, device="cpu").logprobs(items)
        gpu = ReferenceScorer(**common, dtype=dtype, device=gpu_device).logprobs(items)
        cases.append((f"reference log-probs, {dtype}", _gap(cpu, gpu), bound))
    critic = {"path": path, "dtype": "float32", "zero_stage": 0, "pad_id": 0, "max_tokens": 64}
    scorers = [ValueScorer(**critic, device=d) for d in ("cpu", gpu_device)]
    head = {k: torch.randn_like(v) * 0.1 for k, v in scorers[0].model.state_dict().items() if "head" in k}
    weights = Path("/tmp/gpu_stages_critic.safetensors")
    save_file({**{k: v.contiguous() for k, v in scorers[0].model.state_dict().items()}, **head}, str(weights))
    for s in scorers:
        s.load(str(weights), 1)
    cases.append(("critic values, float32", _gap(*(s.values(items) for s in scorers)), 1e-4))
    rm = str(ensure_tiny_reward_model(progress=False))
    texts = [f"{a}+{b}={a + b}" for a, b in zip(range(20), range(5, 25))]
    logits = [Scorer(rm, device=d, max_tokens=64).logits(texts) for d in ("cpu", gpu_device)]
    cases.append(("reward model logits", max(abs(a - b) for a, b in zip(*logits)), 1e-3))
    for name, gap, bound in cases:
        ok = gap <= bound
        failed += [] if ok else [name]
        print(f"{name:32s} max |cpu - cuda| {gap:.2e} (bound {bound:g}) {'ok' if ok else 'FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
