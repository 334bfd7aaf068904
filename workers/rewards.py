"""Built-in reward functions. Signature shared with user code:
``reward(prompt, completion, **fields) -> float`` where fields holds the dataset row
(``answer`` and any extra columns)."""
from __future__ import annotations

import re
from typing import Callable

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _last_number(text: str):
    found = _NUMBER.findall(text or "")
    return float(found[-1]) if found else None


def exact_match(prompt: str, completion: str, answer: str = "", **_) -> float:
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def numeric_match(prompt: str, completion: str, answer: str = "", **_) -> float:
    """1 if the last number in the completion equals the last number in the answer."""
    got, want = _last_number(completion), _last_number(str(answer))
    return 1.0 if got is not None and want is not None and abs(got - want) < 1e-9 else 0.0


def digit_match(prompt: str, completion: str, answer: str = "", **_) -> float:
    """Partial credit for arithmetic: the share of digit places (ones, tens, ...) that
    agree with the answer, over the longer of the two numbers; 1.0 only when exact.
    Denser than numeric_match, so a group of samples rarely scores all alike."""
    got, want = _last_number(completion), _last_number(str(answer))
    if got is None or want is None:
        return 0.0
    if abs(got - want) < 1e-9:
        return 1.0
    a, b = str(int(abs(got)))[::-1], str(int(abs(want)))[::-1]
    same = sum(x == y for x, y in zip(a, b)) * (float(got) * float(want) >= 0)
    return 0.9 * same / max(len(a), len(b))


def format_check(prompt: str, completion: str, pattern: str = r"^[-\d ]+$", **_) -> float:
    return 1.0 if re.fullmatch(pattern, completion.strip() or "") else 0.0


def length_penalty(prompt: str, completion: str, answer: str = "", target_chars: int = 0, **_) -> float:
    """numeric_match minus 0.01 per character beyond the answer's length (or target_chars)."""
    limit = target_chars or len(str(answer))
    return numeric_match(prompt, completion, answer) - 0.01 * max(0, len(completion) - limit)


def countdown_check(prompt: str, completion: str, target: int | None = None, **_) -> float:
    """1 if the completion is an expression of the prompt's numbers (+/- only) equal to target."""
    expr = completion.strip()
    if not re.fullmatch(r"\d+(?:[+-]\d+)*", expr or "x"):
        return 0.0
    nums = prompt.split(">")[0].split()
    if sorted(re.findall(r"\d+", expr)) != sorted(nums):
        return 0.0
    if target is None:
        target = int(prompt.split(">")[1].rstrip(":"))
    return 1.0 if eval(expr, {"__builtins__": {}}) == int(target) else 0.0  # digits and +/- only


BUILTIN_REWARDS: dict[str, Callable[..., float]] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "digit_match": digit_match,
    "format_check": format_check,
    "length_penalty": length_penalty,
    "countdown_check": countdown_check,
}
