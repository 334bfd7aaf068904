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


class DatasetError(ValueError):
    pass


CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages, where: str) -> str:
    """A chat row's ``messages``: a non-empty list of {role, content} strings ending with
    the user's turn (the model writes the next one). Returns that last user message,
    which stands for the row's prompt in rewards, samples and the length ranker."""
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: messages[{k}] must be an object with string 'role' and 'content'")
        if m["role"] not in CHAT_ROLES:
            raise DatasetError(f"{where}: messages[{k}] has role {m['role']!r}; one of {', '.join(CHAT_ROLES)}")
    if messages[-1]["role"] != "user":
        raise DatasetError(f"{where}: the last message must be the user's (the model answers it), "
                           f"not {messages[-1]['role']!r}")
    return messages[-1]["content"]


def load_rows(dataset: str, size: int = 4000, eval_size: int = 200, seed: int = 0,
              prompt_field: str = "prompt", answer_field: str = "answer") -> tuple[list[dict], list[dict]]:
    """Training and held-out rows of a task: a JSONL file or ``gen:<generator>[?k=v&...]``.

    Rows are returned with ``prompt`` and ``answer`` keys (renamed from the configured
    fields); held-out prompts never appear in training.
    """
    import json
    from urllib.parse import parse_qsl

    if dataset.startswith("gen:"):
        name, _, query = dataset[4:].partition("?")
        params = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in parse_qsl(query)}
        rows = generate(name, size + eval_size, seed=seed, **params)
    else:
        try:
            with open(dataset, encoding="utf-8") as fh:
                rows = []
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as exc:
                            raise DatasetError(f"{dataset} line {n}: not JSON ({exc.msg})") from None
        except FileNotFoundError:
            raise DatasetError(f"dataset file {dataset!r} does not exist") from None
    if not rows:
        raise DatasetError(f"dataset {dataset!r} is empty")
    out = []
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict) or answer_field not in row or (prompt_field not in row and "messages" not in row):
            raise DatasetError(f"dataset {dataset!r} row {n} lacks the field {answer_field!r} or a prompt "
                               f"({prompt_field!r}, or a chat 'messages' list)")
        extra = {k: v for k, v in row.items() if k not in (prompt_field, answer_field)}
        if "messages" in row:
            prompt = check_messages(row["messages"], f"dataset {dataset!r} row {n}")
        if prompt_field in row:
            prompt = str(row[prompt_field])
        out.append({**extra, "prompt": prompt, "answer": str(row[answer_field])})
    if len(out) <= eval_size:
        eval_size = max(0, len(out) // 5)
    held_out = out[len(out) - eval_size:] if eval_size else []
    seen = {r["prompt"] for r in held_out}
    train = [r for r in out[: len(out) - eval_size] if r["prompt"] not in seen]
    if not train:
        raise DatasetError(f"dataset {dataset!r} has no training rows left after the held-out split")
    return train, held_out
