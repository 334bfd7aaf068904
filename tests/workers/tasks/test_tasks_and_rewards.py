import json

import pytest

from workers.tasks.builtin_rewards import BUILTIN_REWARDS, countdown_check, digit_match, numeric_match
from workers.tasks.datasets import DatasetError, gen_chain, generate, load_rows


def test_generators_are_deterministic_in_their_seed():
    assert generate("add", 20, seed=3) == generate("add", 20, seed=3)
    assert generate("add", 20, seed=3) != generate("add", 20, seed=4)


def test_chain_answers_are_long_tailed():
    lengths = sorted(len(r["answer"]) for r in gen_chain(2000, seed=0))
    median, longest = lengths[len(lengths) // 2], lengths[-1]
    assert longest >= 10 * lengths[0]
    assert longest >= 4 * median  # a few long ones, most short


def test_chain_answer_is_the_running_sums():
    row = gen_chain(1, seed=1)[0]
    terms = [int(t) for t in row["prompt"].rstrip("=").split("+")]
    sums = [sum(terms[: i + 1]) for i in range(1, len(terms))]
    assert row["answer"] == " ".join(map(str, sums))


def test_countdown_rows_are_solvable_by_their_answer():
    for row in generate("countdown", 50, seed=2):
        assert countdown_check(row["prompt"], row["answer"], target=row["target"]) == 1.0


def test_numeric_match_reads_the_last_number():
    assert numeric_match("1+2=", "3", answer="3") == 1.0
    assert numeric_match("", "5 9 12", answer="5 9 12") == 1.0
    assert numeric_match("", "5 9 13", answer="5 9 12") == 0.0
    assert numeric_match("", "no number", answer="3") == 0.0
    assert set(BUILTIN_REWARDS) >= {"exact_match", "numeric_match", "format_check", "length_penalty"}


def test_digit_match_gives_partial_credit_per_digit_place_and_full_credit_only_when_exact():
    assert digit_match("", "68", answer="68") == 1.0
    assert digit_match("", "58", answer="68") == pytest.approx(0.45)  # ones right, tens wrong
    assert digit_match("", "168", answer="68") == pytest.approx(0.6)  # 2 of 3 places
    assert digit_match("", "6", answer="68") == 0.0  # places align from the ones
    assert digit_match("", "-68", answer="68") == 0.0
    assert digit_match("", "none", answer="68") == 0.0
    assert "digit_match" in BUILTIN_REWARDS


def test_load_rows_splits_held_out_prompts_from_training(tmp_path):
    train, held = load_rows("gen:add?max_digits=2", size=300, eval_size=50, seed=0)
    assert len(held) == 50
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in train}


def test_load_rows_renames_configured_fields_and_keeps_extras(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1), "level": i}) for i in range(10)))
    train, held = load_rows(str(path), eval_size=2, prompt_field="q", answer_field="a")
    assert train[0] == {"prompt": "0+1=", "answer": "1", "level": 0} and len(held) == 2


@pytest.mark.parametrize("content, message", [
    ("", "is empty"),
    ('{"prompt": "1", "answer": "2"}\nnot json\n', "line 2: not JSON"),
    ('{"prompt": "1"}\n', "lacks the field"),
])
def test_malformed_datasets_are_rejected_clearly(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_rows(str(path))


def test_missing_dataset_file_is_named():
    with pytest.raises(DatasetError, match="does not exist"):
        load_rows("/nonexistent/data.jsonl")
