"""Small models of real architectures, with real trained tokenizers and chat templates,
built on this machine: proof that FluxRL trains any Hugging Face causal LM, not only its
character-level tiny model.

Three architectures vLLM and transformers both support:

- ``qwen2``: Qwen2ForCausalLM (RoPE, GQA), a byte-level BPE tokenizer (~2048 pieces,
  digits split one by one as in Qwen2 and Llama 3), the ChatML format
  (``<|im_start|>role\\n...<|im_end|>\\n``);
- ``llama``: LlamaForCausalLM (untied head), a SentencePiece-style Unigram tokenizer
  (~1024 pieces, Metaspace, byte fallback, BOS added by a post-processor) and a
  Llama-3-like format (``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``);
- ``gpt2``: GPT2LMHeadModel (learned absolute positions, Conv1D weights), the BPE
  tokenizer and a Phi-3-like format (``<|user|>\\n...<|end|>\\n``).

Each tokenizer is trained with the ``tokenizers`` library on a synthetic corpus made
here (arithmetic chat exchanges plus English-like sentences, deterministic in the
seed), saved as a ``PreTrainedTokenizerFast`` with its ``chat_template``; each
``generation_config.json`` lists an end-of-turn and an end-of-text id, as real chat
models do. The model is warm-started by a short SFT on chat-formatted 2-digit additions
(loss on the assistant's tokens and its end-of-turn token), stopped while it is still
learning (once greedy accuracy on dev prompts reaches 0.35): held-out greedy accuracy is
left in the middle, so that RL has room to raise it. Single-threaded and deterministic
on a given CPU; vLLM's greedy output on the CPU matches transformers' token for token.

    build_zoo_model("qwen2", "out/qwen2")   # a complete HF folder
    ensure_zoo_model("llama")                # built once, cached under $FLUXRL_MODEL_CACHE
    python -m workers build-model gpt2 [--out DIR] [--steps N]
"""
from __future__ import annotations

import bisect
import functools
import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.models.tinymodel import WEIGHTS, _cpu_model, default_cache, file_sha256, install_folder, recipe_id, sft_lr_factor, \
    verify_model_folder

logger = logging.getLogger(__name__)

ARCHS = ("qwen2", "llama", "gpt2")
MANIFEST = "fluxrl_zoo.json"  # recipe, held-out accuracy, checksum
ASSETS = Path(__file__).resolve().parents[1] / "assets"


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

_COMMON = {
    "seed": 0,
    "hidden": 128,
    "heads": 2,
    "head_dim": 64,  # a size vLLM's CPU attention has kernels for
    "max_positions": 512,
    # The SFT is planned over `schedule_steps` (data and cosine schedule, as the tiny
    # model's) and stopped while held-out accuracy is still climbing steeply, on 2-digit
    # sums most of all: when greedy accuracy on `dev` other prompts reaches
    # `stop_at_accuracy` (checked every `check_every` steps), after `steps` at most.
    # At a peak rate of 3e-3 the SFT was unstable (with some data orders the model was
    # still failing to copy the operands after 1600 steps); at 1.5e-3 to 2e-3 it learned
    # the same way across seeds.
    "batch": 16,
    "final_lr_ratio": 0.1,
    "betas": [0.9, 0.95],
    "stop_at_accuracy": 0.35,
    "dev": 100,
    "check_from": 250,
    "check_every": 25,
    "corpus": {"chat": 6000, "prose": 14000},
    "system_share": 0.3,
    "held_out": 400,
}
RECIPES: dict[str, dict] = {
    "qwen2": {**_COMMON, "arch": "qwen2", "tokenizer": "bpe", "vocab": 2048, "layers": 3, "kv_heads": 1,
              "tie": True, "lr": 1.5e-3, "steps": 1500, "schedule_steps": 2000},
    # Two layers: its prompts are a third longer (Llama 3's headers, a smaller vocabulary),
    # and with two it learned faster per step than with three.
    "llama": {**_COMMON, "arch": "llama", "tokenizer": "unigram", "vocab": 1024, "layers": 2, "kv_heads": 2,
              "tie": False, "lr": 1.5e-3, "steps": 1500, "schedule_steps": 2000},
    # Learned absolute positions: slower to find the operands than RoPE, and no slower
    # with two layers than with three.
    "gpt2": {**_COMMON, "arch": "gpt2", "tokenizer": "bpe", "vocab": 2048, "layers": 2,
             "tie": True, "lr": 2e-3, "steps": 1500, "schedule_steps": 2000},
}


def zoo_recipe(arch: str, steps: int | None = None, seed: int = 0) -> dict:
    """The recipe of ``arch``; ``steps`` runs exactly that many SFT steps (no stop on accuracy)."""
    if arch not in RECIPES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    recipe = {**RECIPES[arch], "seed": seed}
    if steps is not None:
        recipe.update(steps=int(steps), stop_at_accuracy=None)
    return recipe


# --- data -------------------------------------------------------------------------

# One wording: with five, 90 s of SFT left the model still learning where the operands are.
QUESTIONS = ("What is {a} + {b}?",)
SYSTEMS = ("You are a helpful assistant.", "You are a careful calculator. Answer with the whole equation.",
           "Answer briefly.")


def _operand(rng: random.Random, max_digits: int = 2) -> int:
    return rng.randrange(10 ** rng.randint(1, max_digits))  # as tasks.gen_add: 1-digit as often as 2-digit


def _arith_rows(n: int, rng: random.Random, system_share: float, exclude: frozenset = frozenset()) -> list[dict]:
    rows = []
    while len(rows) < n:
        a, b = _operand(rng), _operand(rng)
        messages = [{"role": "user", "content": rng.choice(QUESTIONS).format(a=a, b=b)}]
        if rng.random() < system_share:
            messages.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
        row = {"messages": messages, "answer": str(a + b), "operands": (a, b)}
        if exclude and _held_out_key(row) in exclude:
            continue
        rows.append(row)
    return rows


def _held_out_key(row: dict):
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
        rows += [r for r in _arith_rows(n - len(rows), rng, system_share) if not two_digit or max(r["operands"]) >= 10]
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
    for row in _arith_rows(recipe["corpus"]["chat"], rng, system_share=0.5):
        text = render_chat(fmt.template, row["messages"] + [{"role": "assistant", "content": assistant_reply(row)}],
                           bos_token=fmt.bos or "")
        lines += [part for part in cut.split(text) if part]
    lead = " " if recipe["tokenizer"] == "unigram" else ""
    lines += [lead + s for s in english_sentences(recipe["corpus"]["prose"], seed=recipe["seed"] * 7919 + 29)]
    rng.shuffle(lines)
    return lines


# --- tokenizers -----------------------------------------------------------------------

def _train_bpe(corpus: list[str], fmt: ChatFormat, vocab: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    # Numbers split into single digits first, then GPT-2's byte-level split (as Qwen2 and Llama 3).
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=list(fmt.specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


def _train_unigram(corpus: list[str], fmt: ChatFormat, vocab: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFC()
    # SentencePiece's whitespace as "▁", then each digit a piece of its own
    # (sentencepiece's split_digits).
    def pre_tokenizer(prepend: str):
        return pre_tokenizers.Sequence([pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend),
                                        pre_tokenizers.Digits(individual_digits=True)])

    # Trained on lines that carry their own leading space where a text's start gets one
    # (tokenizer_corpus): the trainer would otherwise prepend "▁" to every line, also to
    # the text between two special tokens, which never gets one.
    tok.pre_tokenizer = pre_tokenizer("never")
    trainer = trainers.UnigramTrainer(vocab_size=vocab - 256, special_tokens=list(fmt.specials), unk_token=fmt.unk,
                                      max_piece_length=16, show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    # Llama's 256 byte pieces <0x00>..<0xFF>: a character never seen in training is
    # spelt in its UTF-8 bytes instead of <unk>. Scored below every learned piece.
    spec = json.loads(tok.to_str())
    n_special = len(fmt.specials)
    assert [p for p, _ in spec["model"]["vocab"][:n_special]] == list(fmt.specials)
    pieces = spec["model"]["vocab"][:n_special] + _canonical_pieces(spec["model"]["vocab"][n_special:])
    have = {p for p, _ in pieces}
    floor = min(score for _, score in pieces) - 10.0
    pieces += [[f"<0x{b:02X}>", floor] for b in range(256) if f"<0x{b:02X}>" not in have]
    spec["model"]["vocab"] = pieces
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.pre_tokenizer = pre_tokenizer("first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # as Llama's
    bos = tok.token_to_id(fmt.bos)
    tok.post_processor = processors.TemplateProcessing(single=f"{fmt.bos} $A", pair=f"{fmt.bos} $A {fmt.bos}:1 $B:1",
                                                       special_tokens=[(fmt.bos, bos)])
    return tok


def _canonical_pieces(pieces: list) -> list:
    """The Unigram trainer's pieces in an order and with scores that do not change from
    run to run. As trained, they do: its EM sums in parallel (scores differ in the 14th
    digit) and it appends the characters it must keep but did not learn in hash-set
    order, at the lowest score plus 1e-4 per character (so ids and scores of those
    characters move between runs). Those characters are put in sorted order, scores
    rounded to 6 decimals, and pieces sorted by score, then text."""
    base = min(score for _, score in pieces)

    def appended(piece: str, score: float) -> bool:
        k = (score - base) / 1e-4
        return len(piece) == 1 and abs(k - round(k)) < 1e-6 and 0 <= round(k) < len(pieces)

    tail = sorted(p for p, score in pieces if appended(p, score))
    rest = [[p, round(score, 6)] for p, score in pieces if not appended(p, score)]
    rest += [[p, round(base + k * 1e-4, 6)] for k, p in enumerate(tail)]
    return sorted(rest, key=lambda item: (-item[1], item[0]))


def build_tokenizer(recipe: dict):
    """The recipe's tokenizer, trained on ``tokenizer_corpus``: a PreTrainedTokenizerFast
    with the architecture's special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    fmt = FORMATS[recipe["arch"]]
    corpus = tokenizer_corpus(recipe)
    train = {"bpe": _train_bpe, "unigram": _train_unigram}[recipe["tokenizer"]]
    core = train(corpus, fmt, recipe["vocab"])
    named = {"bos_token": fmt.bos, "eos_token": fmt.end_of_turn, "pad_token": fmt.pad, "unk_token": fmt.unk}
    named = {k: v for k, v in named.items() if v}
    extra = [t for t in fmt.specials if t not in named.values()]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, extra_special_tokens=extra,
                                        clean_up_tokenization_spaces=False, model_max_length=recipe["max_positions"],
                                        **named)
    tokenizer.chat_template = fmt.template
    return tokenizer


def save_tokenizer(tokenizer, folder: Path) -> None:
    """tokenizer.json and tokenizer_config.json, written as transformers 4 wrote them
    (which transformers 5 reads too, and other tools expect): the chat template inside
    the config, the class name every version knows, the other special tokens under
    their old key (transformers 4 takes ``extra_special_tokens`` for a dict)."""
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    path = Path(folder) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def stop_ids(tokenizer, arch: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in FORMATS[arch].stop]


def padded_vocab(tokenizer) -> int:
    return -(-len(tokenizer) // 64) * 64


# --- models ---------------------------------------------------------------------------

def build_model(recipe: dict, tokenizer):
    """The untrained model: float32, ``vocab_size`` = len(tokenizer) rounded up to 64."""
    import transformers

    arch, fmt = recipe["arch"], FORMATS[recipe["arch"]]
    ids = {k: tokenizer.convert_tokens_to_ids(t) if t else None
           for k, t in (("bos", fmt.bos or fmt.pad), ("eos", fmt.end_of_turn), ("pad", fmt.pad))}
    common = dict(vocab_size=padded_vocab(tokenizer), tie_word_embeddings=recipe["tie"], bos_token_id=ids["bos"],
                  eos_token_id=ids["eos"], pad_token_id=ids["pad"], dtype="float32")
    h, heads, hd = recipe["hidden"], recipe["heads"], recipe["head_dim"]
    if arch == "qwen2":
        if heads * hd != h:  # vLLM's Qwen2 takes the head size to be hidden / heads
            raise ValueError(f"qwen2 needs heads * head_dim == hidden, not {heads} * {hd} != {h}")
        cfg = transformers.Qwen2Config(hidden_size=h, intermediate_size=3 * h, num_hidden_layers=recipe["layers"],
                                       num_attention_heads=heads, num_key_value_heads=recipe["kv_heads"],
                                       head_dim=hd, max_position_embeddings=recipe["max_positions"], **common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "llama":
        cfg = transformers.LlamaConfig(hidden_size=h, intermediate_size=3 * h, num_hidden_layers=recipe["layers"],
                                       num_attention_heads=heads, num_key_value_heads=recipe["kv_heads"],
                                       head_dim=hd, max_position_embeddings=recipe["max_positions"],
                                       rms_norm_eps=1e-5, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=h, n_inner=4 * h, n_layer=recipe["layers"], n_head=heads,
                                      n_positions=recipe["max_positions"], resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, **common)  # no dropout, as the others
        cls = transformers.GPT2LMHeadModel
    else:
        raise ValueError(f"unknown architecture {arch!r}")
    torch.manual_seed(recipe["seed"])
    return cls(cfg)


def generation_config(tokenizer, arch: str):
    from transformers import GenerationConfig

    fmt = FORMATS[arch]
    return GenerationConfig(bos_token_id=tokenizer.convert_tokens_to_ids(fmt.bos or fmt.pad),
                            eos_token_id=stop_ids(tokenizer, arch),
                            pad_token_id=tokenizer.convert_tokens_to_ids(fmt.pad))


# --- warm start -----------------------------------------------------------------------

def prompt_texts(tokenizer, rows: list[dict]) -> list[str]:
    return [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in rows]


def sft_examples(tokenizer, rows: list[dict], arch: str) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per row: the chat prompt, then the assistant's reply
    and its end-of-turn token, encoded as one text (as the tokenizer splits the whole
    conversation) and encoded without the tokenizer's own BOS, since the template writes it."""
    prompts = prompt_texts(tokenizer, rows)
    end = FORMATS[arch].end_of_turn
    enc = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    full = tokenizer([p + assistant_reply(r) + end for p, r in zip(prompts, rows)],
                     add_special_tokens=False)["input_ids"]
    out = []
    for p, f in zip(enc, full):
        if f[: len(p)] != p:
            raise RuntimeError(f"the prompt's tokens are not a prefix of the conversation's: {p} vs {f}")
        out.append((f, len(p)))
    return out


def _batch(examples: list[tuple[list[int], int]], pad_id: int):
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id)
    att = torch.zeros((len(examples), width), dtype=torch.long)
    lab = torch.full((len(examples), width), -100)
    for i, (seq, plen) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        att[i, : len(seq)] = 1
        lab[i, plen: len(seq)] = torch.tensor(seq[plen:])
    return ids, att, lab


def sft_loss(model, ids, att, lab):
    """Mean cross-entropy of the labelled tokens, the output head applied only where a
    label follows (the reply's ~10 positions, not the prompt's ~25): the same loss as
    ``model(..., labels=lab).loss``, for a third of the head's work."""
    hidden = model.base_model(input_ids=ids, attention_mask=att).last_hidden_state
    target = lab[:, 1:]
    keep = target != -100
    logits = model.get_output_embeddings()(hidden[:, :-1][keep])
    return torch.nn.functional.cross_entropy(logits.float(), target[keep])


@torch.no_grad()
def greedy_completions(model, prompts: list[list[int]], stop: list[int], pad_id: int, max_new: int = 16,
                       batch: int = 64) -> list[list[int]]:
    """HF greedy completions (ids up to and including the first stop id). Prompts are
    batched by length, so that no prompt is padded: each is decoded as it would be alone."""
    out: list[list[int] | None] = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    was_training = model.training
    model.eval()
    for idx in by_len.values():
        for k in range(0, len(idx), batch):
            chunk = idx[k:k + batch]
            ids = torch.tensor([prompts[i] for i in chunk])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=stop, pad_token_id=pad_id)
            for i, row in zip(chunk, gen[:, ids.shape[1]:].tolist()):
                cut = next((j for j, t in enumerate(row) if t in stop), None)
                out[i] = row if cut is None else row[: cut + 1]
    model.train(was_training)
    return out


def held_out_rows(recipe: dict) -> list[dict]:
    """The warm start's held-out prompts: never trained on (their operand pairs are left out)."""
    return _arith_rows(recipe["held_out"], random.Random(recipe["seed"] * 1000 + 99), recipe["system_share"])


def greedy_accuracy(model, tokenizer, rows: list[dict], arch: str, max_new: int = 16) -> float:
    """Held-out greedy accuracy: the last number of the completion equals the sum."""
    from workers.tasks.builtin_rewards import numeric_match

    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in prompt_texts(tokenizer, rows)]
    comps = greedy_completions(model, prompts, stop_ids(tokenizer, arch), tokenizer.pad_token_id, max_new)
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in comps]
    return sum(numeric_match("", t, r["answer"]) for t, r in zip(texts, rows)) / max(1, len(rows))


def dev_rows(recipe: dict) -> list[dict]:
    """The prompts the warm start watches to know when to stop (apart from the held-out
    ones, which only measure the result)."""
    return _arith_rows(recipe["dev"], random.Random(recipe["seed"] * 1000 + 98), recipe["system_share"])


def _sft(model, tokenizer, recipe: dict, progress: bool) -> dict:
    """At most ``steps`` steps; with ``stop_at_accuracy``, stopped at the first check (every
    ``check_every`` steps from ``check_from``) where greedy accuracy on the dev prompts
    reaches it. The accuracy climbs steeply once the model has learned where the
    operands are, and when that happens moves with anything that changes the run (the
    tokenizer's ids, the CPU's rounding): a fixed step count would land anywhere
    between 0.15 and 0.65, a stop on accuracy lands in the middle."""
    from tqdm import tqdm

    arch = recipe["arch"]
    held_out, dev = held_out_rows(recipe), dev_rows(recipe)
    exclude = frozenset(_held_out_key(r) for r in held_out + dev)
    steps, batch, target = recipe["steps"], recipe["batch"], recipe.get("stop_at_accuracy")
    rows = _arith_rows(steps * batch, random.Random(recipe["seed"] * 1000 + 1), recipe["system_share"], exclude)
    examples = sft_examples(tokenizer, rows, arch)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], betas=tuple(recipe["betas"]), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: sft_lr_factor(s, recipe))
    model.train()
    t0, loss, dev_accuracy, done = time.time(), torch.tensor(float("nan")), None, 0
    bar = tqdm(range(steps), desc=f"{arch} warm start (SFT)", disable=not progress, unit="step")
    for step in bar:
        ids, att, lab = _batch(examples[step * batch:(step + 1) * batch], tokenizer.pad_token_id)
        loss = sft_loss(model, ids, att, lab)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        done = step + 1
        if step % 25 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", **({"dev": f"{dev_accuracy:.2f}"} if dev_accuracy is not None else {}))
        if target is not None and done >= recipe["check_from"] and done % recipe["check_every"] == 0:
            dev_accuracy = greedy_accuracy(model, tokenizer, dev, arch)
            model.train()
            if dev_accuracy >= target:
                break
    bar.close()
    seconds = time.time() - t0
    accuracy = greedy_accuracy(model, tokenizer, held_out, arch)
    return {"sft_steps": done, "final_loss": round(float(loss.detach()), 4), "sft_seconds": round(seconds, 1),
            "dev_accuracy": dev_accuracy, "held_out_accuracy": accuracy, "held_out_size": len(held_out)}


def build_zoo_model(arch: str, out_dir, *, steps: int | None = None, seed: int = 0, progress: bool = False) -> Path:
    """Train the tokenizer, build and warm-start the model of ``arch`` (one of ARCHS) and
    write a complete HF folder to ``out_dir`` (config, generation config, weights,
    tokenizer with its chat template, and ``fluxrl_zoo.json``: recipe, held-out
    accuracy, weights checksum). ``steps`` overrides the recipe's SFT steps (the
    schedule stays the one planned). Single-threaded and deterministic in ``seed``."""
    recipe = zoo_recipe(arch, steps, seed)
    out = Path(out_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-for-bit reproducible; never oversubscribes a busy machine
    try:
        t0 = time.time()
        tokenizer = build_tokenizer(recipe)
        tokenizer_s = time.time() - t0
        model = build_model(recipe, tokenizer)
        report = _sft(model, tokenizer, recipe, progress)
        out.mkdir(parents=True, exist_ok=True)
        model.generation_config = generation_config(tokenizer, arch)
        model.save_pretrained(out, safe_serialization=True)
        save_tokenizer(tokenizer, out)
    finally:
        torch.set_num_threads(threads)
    manifest = {
        "arch": arch, "architecture": type(model).__name__, "recipe": recipe, **report,
        "tokenizer_seconds": round(tokenizer_s, 1), "len_tokenizer": len(tokenizer),
        "vocab_size": model.config.vocab_size, "eos_token_id": stop_ids(tokenizer, arch),
        "params": sum(p.numel() for p in model.parameters()),
        "built_with": f"torch {torch.__version__}, {_cpu_model()}", "sha256": file_sha256(out / WEIGHTS),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    logger.info("%s: %s params, vocab %d, %d SFT steps in %.1f s, held-out greedy accuracy %.1f%% -> %s", arch,
                f"{manifest['params']:,}", len(tokenizer), report["sft_steps"], report["sft_seconds"],
                100 * report["held_out_accuracy"], out)
    return out


def _zoo_cache_is_good(out: Path, recipe: dict) -> bool:
    if not (out / MANIFEST).exists():
        return False
    try:
        manifest = verify_model_folder(out, MANIFEST)
    except (RuntimeError, ValueError, OSError) as exc:
        logger.warning("zoo model cache %s is damaged (%s): rebuilding it", out, exc)
        return False
    return manifest.get("recipe") == recipe


def shipped_zoo_model(arch: str, recipe: dict) -> Path | None:
    """The warm start of ``arch`` shipped with the project (``workers/assets/zoo-<arch>``,
    about 3 MB each), if it was built from ``recipe``. Shipped for the tiny model's reason:
    the same recipe trained on another CPU is another model (its starting accuracy moves by
    several points), and building the three takes minutes of every fresh install's tests."""
    folder = ASSETS / f"zoo-{arch}"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return folder if manifest.get("recipe") == recipe else None


def ensure_zoo_model(arch: str, root: str | os.PathLike | None = None, *, steps: int | None = None, seed: int = 0,
                     progress: bool = False) -> Path:
    """The folder of the zoo model ``arch`` under ``$FLUXRL_MODEL_CACHE`` (or ``root``) as
    ``zoo-<arch>-<recipe id>``: the shipped warm start for the default recipe (checked
    against its SHA-256), else built once; concurrent callers wait for one builder, and a
    damaged cache is replaced."""
    recipe = zoo_recipe(arch, steps, seed)
    out = Path(root or default_cache()) / f"zoo-{arch}-{recipe_id(recipe)}"
    if _zoo_cache_is_good(out, recipe):
        return out
    shipped = shipped_zoo_model(arch, recipe)

    def build(staging: Path) -> None:
        if shipped is not None:
            shutil.copytree(shipped, staging)
            verify_model_folder(staging, MANIFEST)  # a damaged copy is refused, never installed
            logger.info("%s: shipped warm start -> %s", arch, out)
        else:
            build_zoo_model(arch, staging, steps=steps, seed=seed, progress=progress)

    return install_folder(out, build, lambda: _zoo_cache_is_good(out, recipe))
