"""Synthetic tasks the tiny model learns, so a demo needs no download or upload.

Every generator returns rows ``{"prompt": str, "answer": str, ...}`` and is
deterministic in its seed. ``chain`` has long-tailed output lengths on purpose: most
rows need two or three running sums, a few need a dozen (StreamRL's skewness).
"""
from __future__ import annotations

import random
import re
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


def tool_arith_prompt(a: int, b: int, op: str = "*") -> str:
    """The prompt of a gen:tool_arith row, one wording for training, warm-starting and benches."""
    return f"What is {a} {op} {b}?"


_OPS = {"*": lambda a, b: a * b, "+": lambda a, b: a + b, "-": lambda a, b: a - b}


def gen_tool_arith(n: int, seed: int = 0, digits_a: int = 3, digits_b: int = 2) -> list[dict]:
    """Products a small model cannot work out in its head ("What is 347 * 29?" -> "10063"),
    for the agentic tools task: the calculator (or the Python tool) answers them exactly."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a = rng.randrange(10 ** (digits_a - 1), 10 ** digits_a)
        b = rng.randrange(10 ** (digits_b - 1), 10 ** digits_b)
        rows.append({"prompt": tool_arith_prompt(a, b, "*"), "answer": str(_OPS["*"](a, b)), "a": a, "b": b, "op": "*"})
    return rows


def guess_number_prompt(low: int, high: int, game: int) -> str:
    """The prompt of a gen:guess_number row (the game's number keeps held-out prompts apart
    from training ones)."""
    return (f"Game {game}. I am thinking of a whole number from {low} to {high}. Guess it: answer with one "
            "number, and I will tell you whether my number is higher or lower.")


def gen_guess_number(n: int, seed: int = 0, low: int = 1, high: int = 100) -> list[dict]:
    """A secret whole number in [low, high] for the guess_number environment, which answers
    each guess with higher or lower: {"prompt", "answer" (the secret), "low", "high"}."""
    if high <= low:
        raise DatasetError(f"gen:guess_number needs high above low (got low={low}, high={high})")
    rng = random.Random(seed)
    return [{"prompt": guess_number_prompt(low, high, k), "answer": str(rng.randint(low, high)), "low": low,
             "high": high} for k in range(1, n + 1)]


GENERATORS: dict[str, Callable[..., list[dict]]] = {
    "add": gen_add,
    "chain": gen_chain,
    "countdown": gen_countdown,
    "tool_arith": gen_tool_arith,
    "guess_number": gen_guess_number,
}

# Every parameter a generator takes from a spec (gen:<name>?k=v) or the datasets API, with
# its bounds (inclusive): generating is linear (countdown's expression: quadratic) in them,
# and a row is generated in the web process for a preview and a generated dataset.
GENERATOR_PARAMS: dict[str, dict[str, tuple[int, int]]] = {
    "add": {"max_digits": (1, 100)},
    "chain": {"max_terms": (1, 100), "max_value": (1, 10 ** 9)},
    "countdown": {"numbers": (1, 100), "max_value": (1, 10 ** 9)},
    "tool_arith": {"digits_a": (1, 18), "digits_b": (1, 18)},
    "guess_number": {"low": (-10 ** 9, 10 ** 9), "high": (-10 ** 9, 10 ** 9)},
}
MAX_GENERATED_ROWS = 200_000  # rows of one generated dataset (task.size + task.eval_size)
MAX_GENERATED_CHARS = 20_000_000  # rows x characters a row, about: seconds of one core at the bound
_INTEGER = re.compile(r"-?[0-9]{1,18}")


class DatasetError(ValueError):
    pass


def _row_chars(name: str, params: dict) -> int:
    """About how many characters a row of the generator has (prompt and answer)."""
    digits = len(str(params.get("max_value", 30))) + 1
    if name == "add":
        return 3 * params.get("max_digits", 3) + 2
    if name == "chain":
        return 2 * min(params.get("max_terms", 14), 5) * digits  # a geometric number of terms, ~3 on average
    if name == "tool_arith":
        return 20 + 2 * (params.get("digits_a", 3) + params.get("digits_b", 2))
    if name == "guess_number":
        return 170 + 3 * 11
    return 2 * params.get("numbers", 3) * digits + 2 * digits


def check_generator(name: str, n: int | None = None, params: dict | None = None) -> dict:
    """The generator's parameters checked against GENERATOR_PARAMS and, given n rows, the
    rows against MAX_GENERATED_ROWS and MAX_GENERATED_CHARS: DatasetError naming the
    parameter and its bound. Integer strings (from a gen: query) become ints."""
    if name not in GENERATORS:
        raise DatasetError(f"unknown generator {name!r}; choose one of {sorted(GENERATORS)}")
    allowed = GENERATOR_PARAMS[name]
    out = {}
    for key, value in (params or {}).items():
        if key not in allowed:
            raise DatasetError(f"gen:{name} has no parameter {key!r}; it takes "
                               f"{', '.join(allowed) or 'none'}")
        low, high = allowed[key]
        if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise DatasetError(f"gen:{name} parameter {key} must be an integer from {low} to {high} "
                               f"(the bound on {key}), not {str(value)[:40]!r}")
        out[key] = value
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_GENERATED_ROWS:
            raise DatasetError(f"gen:{name} makes at most {MAX_GENERATED_ROWS} rows (the bound on the rows: "
                               f"task.size + task.eval_size, or n), not {n}")
        chars = n * _row_chars(name, out)
        if chars > MAX_GENERATED_CHARS:
            raise DatasetError(f"gen:{name} with {', '.join(f'{k}={v}' for k, v in out.items()) or 'its defaults'} "
                               f"makes about {chars} characters for {n} rows; the bound is {MAX_GENERATED_CHARS} "
                               "(fewer rows, or smaller parameters)")
    return out


def parse_generator(ref: str, n: int | None = None) -> tuple[str, dict]:
    """gen:<name>[?k=v&...] as (name, checked parameters): check_generator's errors."""
    from urllib.parse import parse_qsl

    name, _, query = ref.removeprefix("gen:").partition("?")
    if len(query) > 1000:
        raise DatasetError(f"gen:{name[:40]}: its parameters are over 1000 characters")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=20)
    except ValueError as exc:
        raise DatasetError(f"gen:{name[:40]}: parameters as k=v&k=v ({exc})") from None
    return name, check_generator(name, n, dict(pairs))


def generate(name: str, n: int, seed: int = 0, **params) -> list[dict]:
    params = check_generator(name, n, params)
    return GENERATORS[name](n, seed=seed, **params)


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

    if dataset.startswith("gen:"):
        name, params = parse_generator(dataset, size + eval_size)
        rows = GENERATORS[name](size + eval_size, seed=seed, **params)
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
