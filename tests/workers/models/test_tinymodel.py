"""The tiny model's warm start: its learning-rate schedule (planned over `schedule_steps`,
stopped at `steps`, while the model is still learning carries), and the shipped weights
that make it the same model on every CPU."""
import json
import shutil

import pytest

from workers.models import tinymodel
from workers.models.tinymodel import (DEFAULT_RECIPE, MANIFEST, WEIGHTS, TinyModelError, ensure_tiny_model, file_sha256,
                               recipe_id, sft_lr_factor, shipped_manifest)


def test_sft_rate_warms_up_then_follows_the_planned_cosine_down_to_its_floor():
    recipe = {"steps": 4, "schedule_steps": 40, "final_lr_ratio": 0.1}  # warm-up: 40 // 20 = 2 steps
    assert sft_lr_factor(0, recipe) == 0.5
    assert sft_lr_factor(1, recipe) == pytest.approx(0.5 * (1 + 0.9969173337331280))  # cos(pi / 40)
    assert sft_lr_factor(20, recipe) == pytest.approx(0.5)
    assert sft_lr_factor(40, recipe) == 0.1 and sft_lr_factor(50, recipe) == 0.1


def test_without_a_planned_length_the_schedule_spans_the_steps_run():
    assert sft_lr_factor(20, {"steps": 40, "final_lr_ratio": 0.0}) == pytest.approx(0.5)
    assert sft_lr_factor(40, {"steps": 40}) == 0.0


def test_default_warm_start_stops_at_half_its_peak_rate():
    last = DEFAULT_RECIPE["steps"] - 1
    assert DEFAULT_RECIPE["steps"] < DEFAULT_RECIPE["schedule_steps"]
    assert sft_lr_factor(last, DEFAULT_RECIPE) == pytest.approx(0.500524, abs=1e-6)


@pytest.fixture
def no_training(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("trained, though shipped weights exist for this recipe")

    monkeypatch.setattr(tinymodel, "_train", refuse)


def test_shipped_weights_match_their_checksum_and_the_default_recipe():
    manifest = shipped_manifest()
    assert manifest["recipe"] == DEFAULT_RECIPE and manifest["source"] == "shipped"
    assert file_sha256(tinymodel.SHIPPED_DIR / WEIGHTS) == manifest["sha256"]


def test_an_empty_cache_gets_the_shipped_weights_without_training(tmp_path, no_training):
    folder = ensure_tiny_model(tmp_path, progress=False)
    assert folder.name == f"tiny-{recipe_id(DEFAULT_RECIPE)}"
    assert file_sha256(folder / WEIGHTS) == shipped_manifest()["sha256"]
    assert (folder / "tokenizer.json").exists() and (folder / "config.json").exists()
    assert ensure_tiny_model(tmp_path, progress=False) == folder  # the second call finds it


def test_a_corrupted_or_older_cache_is_replaced_by_the_shipped_weights(tmp_path, no_training):
    folder = ensure_tiny_model(tmp_path, progress=False)
    with open(folder / WEIGHTS, "r+b") as f:  # one flipped byte
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    ensure_tiny_model(tmp_path, progress=False)
    assert file_sha256(folder / WEIGHTS) == shipped_manifest()["sha256"]
    # A cache built by an earlier version (no checksum recorded) is replaced too.
    (folder / MANIFEST).write_text(json.dumps({"recipe": DEFAULT_RECIPE, "held_out_accuracy": 0.5}))
    ensure_tiny_model(tmp_path, progress=False)
    assert json.loads((folder / MANIFEST).read_text())["sha256"] == shipped_manifest()["sha256"]


def test_a_damaged_shipped_copy_is_refused_and_nothing_is_half_installed(tmp_path, monkeypatch, no_training):
    shipped = tmp_path / "shipped"
    shutil.copytree(tinymodel.SHIPPED_DIR, shipped)
    (shipped / WEIGHTS).write_bytes((shipped / WEIGHTS).read_bytes()[:-10])  # truncated
    monkeypatch.setattr(tinymodel, "SHIPPED_DIR", shipped)
    cache = tmp_path / "cache"
    with pytest.raises(TinyModelError, match="SHA-256"):
        ensure_tiny_model(cache, progress=False)
    assert not [p for p in cache.iterdir() if not p.name.endswith(".lock")]


def test_another_recipe_is_trained_and_records_its_checksum(tmp_path):
    recipe = {"hidden": 16, "layers": 1, "heads": 1, "steps": 2, "schedule_steps": 4, "batch": 4}
    folder = ensure_tiny_model(tmp_path, recipe, progress=False)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["source"] == "trained" and manifest["recipe"] == {**DEFAULT_RECIPE, **recipe}
    assert manifest["sha256"] == file_sha256(folder / WEIGHTS)

