"""The zoo's chat formats and synthetic text (workers/models/modelzoo.py): each architecture's
special tokens and chat template, the chat arithmetic rows its SFT and RL tasks use, the
English-like sentences, and the corpus its tokenizer is trained on; all deterministic in
the seed."""
from __future__ import annotations

import bisect
import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChatFormat:
    """A tokenizer's special tokens and chat template. ``specials`` get the first ids."""

    specials: tuple[str, ...]
    end_of_turn: str  # ends the assistant's turn: the SFT target's last token
    stop: tuple[str, ...]  # generation_config's eos_token_id, end of turn first
    template: str
    bos: str | None = None
    pad: str | None = None
    unk: str | None = None


# ChatML, as Qwen2-Instruct (no default system message).
CHATML = ChatFormat(
    specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    end_of_turn="<|im_end|>", stop=("<|im_end|>", "<|endoftext|>"), pad="<|endoftext|>",
    template=(
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
)

# Llama 3's headers on a SentencePiece-style vocabulary: the template writes the BOS
# (so a chat prompt is encoded without the post-processor's), raw text gets it from
# the post-processor.
LLAMA3 = ChatFormat(
    specials=("<unk>", "<s>", "</s>", "<pad>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    end_of_turn="<|eot_id|>", stop=("<|eot_id|>", "</s>"), bos="<s>", pad="<pad>", unk="<unk>",
    template=(
        "{{- bos_token }}"
        "{%- for message in messages %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
        " + '<|eot_id|>' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    ),
)

# Phi-3-like role tokens on GPT-2's <|endoftext|>.
ROLES = ChatFormat(
    specials=("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    end_of_turn="<|end|>", stop=("<|end|>", "<|endoftext|>"), bos="<|endoftext|>", pad="<|endoftext|>",
    template=(
        "{%- for message in messages %}"
        "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
        "{{- raise_exception('roles are system, user and assistant, not ' + message['role']) }}"
        "{%- endif %}"
        "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
    ),
)

FORMATS = {"qwen2": CHATML, "llama": LLAMA3, "gpt2": ROLES}


# --- data -------------------------------------------------------------------------

# One wording: with five, 90 s of SFT left the model still learning where the operands are.
QUESTIONS = ("What is {a} + {b}?",)
SYSTEMS = ("You are a helpful assistant.", "You are a careful calculator. Answer with the whole equation.",
           "Answer briefly.")


def _operand(rng: random.Random, max_digits: int = 2) -> int:
    return rng.randrange(10 ** rng.randint(1, max_digits))  # as tasks.gen_add: 1-digit as often as 2-digit


def arith_rows(n: int, rng: random.Random, system_share: float, exclude: frozenset = frozenset()) -> list[dict]:
    rows = []
    while len(rows) < n:
        a, b = _operand(rng), _operand(rng)
        messages = [{"role": "user", "content": rng.choice(QUESTIONS).format(a=a, b=b)}]
        if rng.random() < system_share:
            messages.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
        row = {"messages": messages, "answer": str(a + b), "operands": (a, b)}
        if exclude and held_out_key(row) in exclude:
            continue
        rows.append(row)
    return rows


def held_out_key(row: dict):
    """What a held-out row keeps out of training: its operand pair when one of them has
    two digits (a sum the model must work out), else its exact prompt (the 100 one-digit
    sums are facts to learn, asked in other words in training)."""
    a, b = row["operands"]
    return (a, b) if max(a, b) >= 10 else json.dumps(row["messages"])


def chat_arithmetic_rows(n: int, seed: int = 0, system_share: float = 0.3, two_digit: bool = False) -> list[dict]:
    """JSONL-ready chat rows of 2-digit additions (a FluxRL chat dataset):
    ``{"messages": [{"role": "user", "content": "What is 23 + 45?"}], "answer": "68"}``,
    a share of them with a system message first. Deterministic in ``seed``. With
    ``two_digit``, only sums with a 2-digit operand: the 100 one-digit sums are facts the
    warm start knows, and as held-out prompts they would keep their questions out of training."""
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        rows += [r for r in arith_rows(n - len(rows), rng, system_share) if not two_digit or max(r["operands"]) >= 10]
    return [{"messages": r["messages"], "answer": r["answer"]} for r in rows]


def write_chat_dataset(path, n: int, seed: int = 0, two_digit: bool = False) -> Path:
    """``chat_arithmetic_rows(n, seed, two_digit=two_digit)`` as a JSONL file; returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in chat_arithmetic_rows(n, seed, two_digit=two_digit):
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def assistant_reply(row: dict) -> str:
    """What the warm start teaches the model to answer: the whole equation."""
    a, b = row["operands"]
    return f"{a} + {b} = {row['answer']}"


_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "br", "ch", "cl", "dr",
           "fl", "gr", "pl", "sh", "st", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt")
_NOUNS = ("time", "year", "people", "way", "day", "man", "woman", "child", "world", "life", "hand", "part", "place",
          "case", "week", "company", "system", "program", "question", "number", "night", "point", "home", "water",
          "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job",
          "word", "business", "issue", "side", "kind", "head", "house", "service", "friend", "father", "power",
          "hour", "game", "line", "end", "member", "law", "car", "city", "name", "team", "minute", "idea", "kid",
          "body", "information", "back", "parent", "face", "level", "office", "door", "health", "person", "art",
          "war", "history", "party", "result", "change", "morning", "reason", "research", "girl", "guy", "moment",
          "air", "teacher", "force", "education", "river", "garden", "apple", "window", "letter", "train", "bridge")
_VERBS = ("saw", "found", "made", "took", "gave", "told", "kept", "left", "brought", "held", "wrote", "read", "built",
          "bought", "sold", "opened", "closed", "carried", "counted", "painted", "moved", "watched", "helped",
          "followed", "visited", "cleaned", "answered", "checked", "added", "wanted", "needed", "liked", "used")
_ADJECTIVES = ("good", "new", "first", "last", "long", "great", "little", "own", "other", "old", "right", "big", "high",
               "different", "small", "large", "next", "early", "young", "important", "few", "public", "bad", "same",
               "able", "quiet", "bright", "green", "red", "blue", "cold", "warm", "heavy", "light", "simple", "strange")
_ADVERBS = ("quickly", "slowly", "carefully", "often", "never", "always", "again", "later", "soon", "together")
_PLACES = ("Paris", "London", "Zürich", "São Paulo", "Kraków", "Tokyo", "Berlin", "Dublin", "Oslo", "Lima")
_EXTRAS = ("café", "naïve", "résumé", "façade", "jalapeño", "coöperate", "über", "niño", "déjà vu", "smörgåsbord")


def _lexicon(rng: random.Random, n: int) -> list[str]:
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3)))
                  + rng.choice(_CODAS))
    return sorted(words)


@functools.lru_cache(maxsize=8)
def _zipf_cumulative(n: int, s: float) -> tuple[float, ...]:
    total, cum = 0.0, []
    for k in range(n):
        total += 1.0 / (k + 1) ** s
        cum.append(total)
    return tuple(cum)


def _zipf(rng: random.Random, items, s: float = 1.1):
    """An item drawn with weight 1/(k+1)^s for the k-th (by inverse transform)."""
    cum = _zipf_cumulative(len(items), s)
    return items[min(len(items) - 1, bisect.bisect_left(cum, rng.random() * cum[-1]))]


def english_sentences(n: int, seed: int = 0) -> list[str]:
    """Simple English-like sentences: real function words and common nouns and verbs,
    pseudo-words for names and rare things, numbers, punctuation, a little non-ASCII."""
    rng = random.Random(seed)
    names = [w.capitalize() for w in _lexicon(rng, 300)]
    things = _lexicon(rng, 2500)

    def noun():
        return _zipf(rng, _NOUNS) if rng.random() < 0.6 else _zipf(rng, things)

    def np_():
        det = rng.choice(("the", "a", "this", "that", "my", "our", "every", "the"))
        adj = rng.choice(_ADJECTIVES) + " " if rng.random() < 0.4 else ""
        return f"{det} {adj}{noun()}"

    patterns = (
        lambda: f"{np_().capitalize()} {rng.choice(_VERBS)} {np_()}.",
        lambda: f"{_zipf(rng, names)} {rng.choice(_VERBS)} {rng.randint(2, 999)} {noun()}s in {rng.choice(_PLACES)}.",
        lambda: f"In {rng.randint(1800, 2030)}, {_zipf(rng, names)} {rng.choice(_ADVERBS)} {rng.choice(_VERBS)} "
                f"{np_()}.",
        lambda: f"Why did {_zipf(rng, names)} leave {np_()} near the {noun()}?",
        lambda: f"\u201c{np_().capitalize()} is {rng.choice(_ADJECTIVES)},\u201d said {_zipf(rng, names)} \u2014 "
                f"{rng.choice(_ADVERBS)}.",
        lambda: f"We {rng.choice(_VERBS)} {rng.randint(1, 99)} {noun()}s and {rng.randint(1, 99)} {noun()}s at the "
                f"{rng.choice(_EXTRAS)}; it cost \u20ac{rng.randint(1, 500)}.",
        lambda: f"{np_().capitalize()} and {np_()} {rng.choice(_VERBS)} {np_()}, then {rng.choice(_VERBS)} it "
                f"{rng.choice(_ADVERBS)}!",
    )
    return [rng.choice(patterns)() for _ in range(n)]


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = False, **tokens) -> str:
    """A chat template rendered as transformers renders it (before any tokenizer exists)."""
    return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **tokens)


def tokenizer_corpus(recipe: dict) -> list[str]:
    """The text a zoo tokenizer is trained on: whole chat exchanges rendered with the
    architecture's template and cut at its special tokens (which are added, not
    learned), so that pieces are learned from the text the tokenizer will see between
    them, plus English-like sentences. For the SentencePiece-style tokenizer, a sentence
    starts with the space its Metaspace adds at the start of a text."""
    import re

    fmt = FORMATS[recipe["arch"]]
    rng = random.Random(recipe["seed"] * 7919 + 17)
    cut = re.compile("|".join(re.escape(t) for t in fmt.specials))
    lines = []
    for row in arith_rows(recipe["corpus"]["chat"], rng, system_share=0.5):
        text = render_chat(fmt.template, row["messages"] + [{"role": "assistant", "content": assistant_reply(row)}],
                           bos_token=fmt.bos or "")
        lines += [part for part in cut.split(text) if part]
    lead = " " if recipe["tokenizer"] == "unigram" else ""
    lines += [lead + s for s in english_sentences(recipe["corpus"]["prose"], seed=recipe["seed"] * 7919 + 29)]
    rng.shuffle(lines)
    return lines
