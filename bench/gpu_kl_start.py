"""Does the KL penalty start at exactly 0 on this device? The trainer's policy forward
runs with gradients, the frozen KL reference's without (``Trainer._logprobs``); at the
first step both hold the same weights, and the KL is 0 only if the two forwards give
bit-identical log-probs. On a GPU the attention kernel could depend on whether gradients
are wanted; this compares them directly, in plain PyTorch and transformers, for the
trainer's three precisions (fp32 weights under bf16 or fp16 autocast at ZeRO 0, bf16
weights at ZeRO 1-3), with SDPA's default, math and memory-efficient kernels, padded and
not.

    .venv/bin/python bench/gpu_kl_start.py        # cuda when there is one, else the CPU

Prints k2 = ½·mean(r²) and max |r| per case (r: the log-prob difference); exit 0 only if
every case is exactly 0. Measured on one H200: every case 0 (docs/benchmarks.md, "On a GPU").
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from workers.models.tinymodel import ensure_tiny_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded sequences of 8-20 tokens, as the trainer packs them."""
    g = torch.Generator().manual_seed(0)
    lengths = [8 + (i * 5) % 13 for i in range(n)]
    ids = torch.zeros(n, max(lengths), dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, length in enumerate(lengths):
        ids[i, :length] = torch.randint(3, 14, (length,), generator=g)
        att[i, :length] = 1
    return ids.to(DEVICE), att.to(DEVICE)


def _load(path: Path, dtype: torch.dtype, grad: bool):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()
    return model.requires_grad_(grad)


def _logprobs(model, ids, att, grad: bool, autocast, backend=None) -> torch.Tensor:
    with (torch.enable_grad() if grad else torch.no_grad()), \
            (torch.autocast(DEVICE, dtype=autocast) if autocast else contextlib.nullcontext()), \
            (sdpa_kernel(backend) if backend else contextlib.nullcontext()):
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0].detach()


def main() -> int:
    path = ensure_tiny_model(progress=False)
    ids, att = _batch()
    full = torch.ones_like(att)
    print(f"device {DEVICE}, torch {torch.__version__}")
    worst = 0.0
    for name, weights, autocast in [("autocast bf16 (ZeRO 0)", torch.float32, torch.bfloat16),
                                    ("bf16 weights (ZeRO 1-3)", torch.bfloat16, None),
                                    ("autocast fp16 (ZeRO 0)", torch.float32, torch.float16)]:
        if DEVICE == "cpu" and autocast is torch.float16:
            continue  # the trainer refuses fp16 on the CPU
        policy, reference = _load(path, weights, True), _load(path, weights, False)
        for label, mask, backend in [("default kernel", att, None), ("math", att, SDPBackend.MATH),
                                     ("memory-efficient", att, SDPBackend.EFFICIENT_ATTENTION),
                                     ("no padding", full, None)]:
            if DEVICE == "cpu" and backend is SDPBackend.EFFICIENT_ATTENTION:
                continue
            r = _logprobs(policy, ids, mask, True, autocast, backend) - _logprobs(reference, ids, mask, False,
                                                                                    autocast, backend)
            m = mask[:, 1:].float()
            k2, top = float((0.5 * r * r * m).sum() / m.sum()), float((r.abs() * m).max())
            worst = max(worst, top)
            print(f"{name:25s} {label:17s} k2 {k2:.3g}  max|r| {top:.3g}")
    print("the KL starts at exactly 0" if worst == 0 else f"NOT 0 at the start: max |r| {worst:.3g}")
    return 0 if worst == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
