"""Synthetic tasks the tiny model learns, so a demo needs no download or upload.

Every generator returns rows ``{"prompt": str, "answer": str, ...}`` and is
deterministic in its seed. ``chain`` has long-tailed output lengths on purpose: most
rows need two or three running sums, a few need a dozen (StreamRL's skewness).
"""
from __future__ import annotations

import random
from typing import Callable


def gen_add(n: int, seed: int = 0, max_digits: int = 3) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a = rng.randrange(10 ** rng.randint(1, max_digits))
        b = rng.randrange(10 ** rng.randint(1, max_digits))
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def chain_terms(rng: random.Random, max_terms: int) -> int:
    """Geometric-ish number of terms: 2 most often, a long tail up to max_terms."""
    k = 2
    while k < max_terms and rng.random() < 0.55:
        k += 1
    return k


def gen_chain(n: int, seed: int = 0, max_terms: int = 14, max_value: int = 30) -> list[dict]:
    """Running sums: "3+14+5=" -> "17 22". The answer is the last number."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        terms = [rng.randrange(max_value) for _ in range(chain_terms(rng, max_terms))]
        sums, total = [], terms[0]
        for t in terms[1:]:
            total += t
            sums.append(str(total))
        rows.append({"prompt": "+".join(map(str, terms)) + "=", "answer": " ".join(sums), "terms": len(terms)})
    return rows


def gen_countdown(n: int, seed: int = 0, numbers: int = 3, max_value: int = 20) -> list[dict]:
    """Reach a target with + and - on given numbers: "5 3 9>11:" -> "5-3+9"."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        nums = [rng.randint(1, max_value) for _ in range(numbers)]
        expr, total = str(nums[0]), nums[0]
        for x in nums[1:]:
            if rng.random() < 0.5:
                expr, total = f"{expr}+{x}", total + x
            else:
                expr, total = f"{expr}-{x}", total - x
        rows.append({"prompt": " ".join(map(str, nums)) + f">{total}:", "answer": expr, "target": total})
    return rows


GENERATORS: dict[str, Callable[..., list[dict]]] = {
    "add": gen_add,
    "chain": gen_chain,
    "countdown": gen_countdown,
}


def generate(name: str, n: int, seed: int = 0, **params) -> list[dict]:
    if name not in GENERATORS:
        raise ValueError(f"unknown generator {name!r}; choose one of {sorted(GENERATORS)}")
    return GENERATORS[name](n, seed=seed, **params)
