"""A short LoRA RL run end to end (model.lora; in this process, as test_sync_run.py): the
trainer trains the adapter alone, each weight update sends only the adapter (well under
5% of the model's bytes, reported beside them), the engine serves it as a vLLM LoRA with
in-flight (keep) updates within the staleness bound, the KL reference is the base model,
and training changes the policy."""
import asyncio
import json

import pytest
import torch

from workers.coord.controller import Controller
from workers.spec import validate_spec


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_a_lora_run_sends_only_the_adapter_and_changes_the_policy(tmp_path, tiny_model_path):
    spec = validate_spec({
        "name": "lora-run", "model": {"path": "builtin:tiny", "lora": {"rank": 8, "alpha": 16,
                                                                        "target_modules": ["q_proj", "v_proj"]}},
        "task": {"dataset": "gen:add?max_digits=2", "size": 400, "eval_size": 16},
        "reward": {"function": "numeric_match"},
        "algorithm": {"loss": "ppo", "group_size": 4, "lr": 5e-3, "warmup_steps": 0, "kl_coef": 0.05},
        "rollout": {"engines": 1, "max_tokens": 8, "update_mode": "keep"},
        "schedule": {"mode": "async", "max_staleness": 1, "batch_prompts": 8},
        "stop": {"max_steps": 8, "max_minutes": 5},
        "eval": {"every_steps": 0, "prompts": 16},
    })
    result = asyncio.run(Controller(spec, tmp_path / "out", progress=False).run())
    assert result.steps == 8 and result.staleness_max <= 1
    points = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]

    def series(key):
        return [p["value"] for p in points if p["key"] == key]

    update, full = series("weights/update_bytes"), series("weights/model_bytes")
    assert len(update) == 8 and len(full) == 8
    assert all(u < 0.05 * f for u, f in zip(update, full))  # the adapter alone: 3 x 2 x 8 x 256 floats + header
    assert full[0] == 657408 * 4 and 3 * 2 * 8 * 256 * 4 <= update[0] < 3 * 2 * 8 * 256 * 4 + 8192
    assert max(series("staleness/max")) <= 1
    assert max(series("loss/kl")) > 0  # the reference (the base model, the adapter disabled) and the policy part

    # the final model is the base with the trained adapter merged in, and the adapter beside it
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = tmp_path / "out" / "final_model"
    merged = AutoModelForCausalLM.from_pretrained(str(final)).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                                        str(final / "adapter")).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        out = merged(input_ids=ids).logits
        assert (out - base(input_ids=ids).logits).abs().max() > 1e-3  # training changed the policy
        assert torch.allclose(out, adapted(input_ids=ids).logits, atol=1e-4)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(1200)
def test_a_lora_run_stopped_by_sigterm_resumes_with_the_checkpoints_adapter_in_trainer_and_engine(tmp_path,
                                                                                                   tiny_model_path):
    import os
    import signal

    import yaml

    from tests.workers.coord.test_resume import SPEC, engine, trained_steps, wait_for_trained_step
    from workers.io.checkpoint import latest_checkpoint

    steps = 30
    spec = {**SPEC, "name": "lora-resume", "stop": {"max_steps": steps, "max_minutes": 5},
            "model": {"path": "builtin:tiny", "lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]}}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    first = engine(tmp_path)
    wait_for_trained_step(first, out, tmp_path / "engine0.log", 0)
    os.kill(first.pid, signal.SIGTERM)  # the step in progress finishes, a checkpoint is saved after it
    assert first.wait(timeout=300) == 130, (tmp_path / "engine0.log").read_text()[-3000:]
    checkpoint = latest_checkpoint(out)
    assert checkpoint is not None and (checkpoint.path / "model" / "adapter" / "adapter_config.json").is_file()

    second = engine(tmp_path, "--resume")
    assert second.wait(timeout=400) == 0, (tmp_path / "engine1.log").read_text()[-3000:]
    assert trained_steps(out) == list(range(1, steps + 1))
    resumed = json.loads((out / "resume.json").read_text())
    # the adapter the trainer restored and the one the engine serves are the checkpoint's
    assert resumed["from_step"] == checkpoint.step
    assert resumed["checkpoint_sha256"] == resumed["trainer_sha256"]
    assert resumed["engine_sha256"] == [resumed["trainer_sha256"]]
