"""The zoo's tokenizers (workers/models/modelzoo.py): a byte-level BPE or a SentencePiece-style
Unigram trained with the ``tokenizers`` library on ``tokenizer_corpus``, wrapped as a
``PreTrainedTokenizerFast`` with the architecture's special tokens and chat template."""
from __future__ import annotations

import json
from pathlib import Path

from workers.models.zoo_data import FORMATS, ChatFormat, tokenizer_corpus


def train_bpe(corpus: list[str], fmt: ChatFormat, vocab: int):
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
    train = {"bpe": train_bpe, "unigram": _train_unigram}[recipe["tokenizer"]]
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

