"""Built-in reward functions. Signature shared with user code:
``reward(prompt, completion, **fields) -> float`` where fields holds the dataset row
(``answer`` and any extra columns) and, for a component of ``reward.components``, its
``params`` (which win over row fields of the same name).

Standard library only: the platform's "try it" runs this module's source in the sandbox."""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Callable, Optional, Union

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _last_number(text: str):
    found = _NUMBER.findall(text or "")
    return float(found[-1]) if found else None


# --- math answers ---------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")
_GSM8K = re.compile(r"^[ \t]*####[ \t]*(\S.*?)[ \t]*$", re.MULTILINE)
# 1,234.5 | 12.5 | .5 | 3/4 (a signed number; a comma only between groups of three digits)
_ANSWER_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:/\d+)?|\.\d+)")
_UNWRAP = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_FRAC = re.compile(r"^(-?)\\frac\s*(?:\{\s*(-?[\d.]+)\s*\}|(\d))\s*(?:\{\s*(-?[\d.]+)\s*\}|(\d))$")


def _braced(text: str, start: int) -> Optional[int]:
    """Index of the brace closing the one at text[start], or None if it never closes."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def boxed_answers(text: str) -> list[str]:
    """The contents of every complete ``\\boxed{...}`` (nested braces kept whole, e.g.
    ``\\boxed{\\frac{1}{2}}``) and ``\\boxed 5``, in order; an unclosed box is skipped."""
    found = []
    for m in _BOXED.finditer(text or ""):
        at = m.end()
        if text.startswith("{", at):
            end = _braced(text, at)
            if end is not None:
                found.append(text[at + 1:end].strip())
        elif m.group()[-1].isspace():  # "\\boxed 5": the next token
            token = re.match(r"[^\s$}]+", text[at:])
            if token:
                found.append(token.group())
    return found


def _gsm8k_answer(line: str) -> str:
    """A '#### ...' line's answer: all of it, or its first number if it is not one ("72 apples")."""
    if isinstance(normalize_answer(line), Fraction):
        return line
    number = _ANSWER_NUMBER.search(line.replace("\u2212", "-"))
    return number.group() if number else line


def extract_answer(text: str) -> Optional[str]:
    """The final answer in a solution: the content of the LAST ``\\boxed{...}``, else the
    last GSM8K ``#### N`` line, else the last number; None when there is none (or the
    last box is empty)."""
    text = text or ""
    found, answer = _marked_answer(text)
    if found:
        return answer
    numbers = _ANSWER_NUMBER.findall(text.replace("\u2212", "-"))
    return numbers[-1] if numbers else None


def _marked_answer(text: str) -> tuple[bool, Optional[str]]:
    """(whether the text marks its answer, the answer): the content of the last ``\\boxed{...}``
    (None when empty), else the last GSM8K ``#### N`` line's."""
    boxed = boxed_answers(text)
    if boxed:
        return True, boxed[-1] or None
    marked = _GSM8K.findall(text)
    if marked:
        return True, _gsm8k_answer(marked[-1])
    return False, None


def reference_answer(answer) -> Optional[str]:
    """A dataset's reference answer: a full solution's boxed or ``#### N`` answer (GSM8K's
    answer field), else the whole text, taken as given ("72", "\\frac{1}{2}", "(3, -1)")."""
    text = str(answer if answer is not None else "")
    found, marked = _marked_answer(text)
    return marked if found else text.strip() or None


def normalize_answer(answer: Optional[str]) -> Union[Fraction, str, None]:
    """A comparable form: a Fraction for a number ("$1,234.00", "50%", "3.0", "-3/4",
    "\\frac{1}{2}", "x = 5"), else the text without whitespace and LaTeX spacing/wrappers."""
    if answer is None:
        return None
    s = str(answer).replace("\u2212", "-")
    for _ in range(3):  # \text{\textbf{5}}
        s = _UNWRAP.sub(r"\1", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])|\\[,;:! ]|\^\s*\{?\s*\\circ\s*\}?|\\?\$|\\?%", "", s)
    s = "".join(s.split())
    s = re.sub(r"^[A-Za-z]\w*=(?!=)", "", s)  # "x=5" -> "5"
    s = s.rstrip(".")
    number = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    try:  # ValueError: past Python's 4300-digit int limit; ZeroDivisionError: x/0
        if re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)", number):
            return Fraction(number)
        fraction = re.fullmatch(r"(-?\d+)/(\d+)", number)
        if fraction:
            return Fraction(int(fraction.group(1)), int(fraction.group(2)))
        frac = _FRAC.fullmatch(number)
        if frac:
            sign, num, den = frac.group(1), frac.group(2) or frac.group(3), frac.group(4) or frac.group(5)
            value = Fraction(num) / Fraction(den)
            return -value if sign else value
    except (ValueError, ZeroDivisionError):
        pass
    return s


def answers_equal(got: Optional[str], want: Optional[str]) -> bool:
    """Numbers compare by value (3.0 == 3, 0.5 == 1/2 == \\frac{1}{2}), anything else as
    text with whitespace removed; a missing answer equals nothing."""
    a, b = normalize_answer(got), normalize_answer(want)
    return a is not None and b is not None and a != "" and a == b


def math_answer(prompt: str, completion: str, answer: str = "", **_) -> float:
    """1 if the completion's final answer (last \\boxed{}, else '#### N', else last number)
    equals the reference (a full solution's boxed / '#### N' answer, or the bare answer),
    numbers compared by value: '$1,234.00' == '1234', '\\frac{1}{2}' == '0.5'."""
    return 1.0 if answers_equal(extract_answer(completion), reference_answer(answer)) else 0.0


def format_boxed(prompt: str, completion: str, **_) -> float:
    """1 if the completion gives its answer in a complete, non-empty \\boxed{...}."""
    return 1.0 if any(boxed_answers(completion)) else 0.0


def format_gsm8k(prompt: str, completion: str, **_) -> float:
    """1 if the completion has a GSM8K answer line '#### N' with N a number."""
    return 1.0 if any(isinstance(normalize_answer(_gsm8k_answer(m)), Fraction)
                      for m in _GSM8K.findall(completion or "")) else 0.0


def format_regex(prompt: str, completion: str, pattern: Optional[str] = None, **_) -> float:
    """1 if the regex `pattern` (a component param) is found anywhere in the completion
    (re.search; format_check instead matches the whole stripped completion)."""
    if not pattern:
        raise ValueError("format_regex needs a pattern: give it in the component's params")
    return 1.0 if re.search(pattern, completion or "") else 0.0


# --- general -------------------------------------------------------------------------------


def exact_match(prompt: str, completion: str, answer: str = "", **_) -> float:
    """1 if the stripped completion equals the stripped answer."""
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
    """1 if the whole stripped completion matches the regex `pattern` (default: digits,
    spaces and minus signs only)."""
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
    "math_answer": math_answer,
    "format_boxed": format_boxed,
    "format_gsm8k": format_gsm8k,
    "format_regex": format_regex,
}
